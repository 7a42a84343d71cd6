"""Widening a trained head to more draft tokens keeps what it learned and extends its drift to new rows."""

from __future__ import annotations

import pytest
import torch

from specdistill.config import HeadConfig, TargetConfig
from specdistill.data.vocab import build_draft_vocab
from specdistill.export.common import check_eagle3
from specdistill.heads.build import build_head
from specdistill.heads.checkpoint import load_head, save_head
from specdistill.heads.widen import widened
from specdistill.target import load_target


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(name="random"))


def counts_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, 1000, (vocab_size,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_widened_head_keeps_trained_rows_and_maps_new_ones_through_the_drift(target, kind, tmp_path):
    lm_head_VD = target.model.get_output_embeddings().weight.float()
    V, D = lm_head_VD.shape
    counts = counts_for(V)
    narrow, wide = build_draft_vocab(counts, 128), build_draft_vocab(counts, 320)
    torch.manual_seed(0)
    head = build_head(HeadConfig(kind=kind), target, narrow.d2t_N, narrow.t2d_V)
    drift_DD = torch.eye(D) + 0.3 * torch.randn(D, D) / D**0.5  # what "training" did to every row alike
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_head_VD[narrow.target_ids_N] @ drift_DD)

    out, fit_cos = widened(head, lm_head_VD, wide)
    assert fit_cos > 0.999
    assert out.config.draft_vocab_size == 320 and torch.equal(out.t2d, wide.t2d_V)
    torch.testing.assert_close(out.lm_head.weight, lm_head_VD[wide.target_ids_N] @ drift_DD, atol=1e-4, rtol=1e-4)
    trained = wide.t2d_V.cumsum(0)[narrow.target_ids_N] - 1  # the trained tokens' rows in the wide head
    assert torch.equal(out.lm_head.weight[trained], head.lm_head.weight)  # kept bit for bit
    assert torch.equal(out.draft_to_target(trained), narrow.target_ids_N)
    for key, value in head.trainable_state_dict().items():
        if key not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(out.trainable_state_dict()[key], value), key

    hidden = torch.randn(3, D)  # same hidden state: the trained tokens keep their logits, order included
    torch.testing.assert_close(out.logits(hidden)[:, trained], head.logits(hidden))
    save_head(out, tmp_path)
    reloaded = load_head(tmp_path)
    assert torch.equal(reloaded.lm_head.weight, out.lm_head.weight) and torch.equal(reloaded.d2t, out.d2t)
    if kind == "eagle3":
        check_eagle3(out.trainable_state_dict(), out.config, "widened", num_aux=3)  # what every writer checks


def test_widening_to_a_vocabulary_without_the_trained_tokens_is_refused(target):
    V = target.config.vocab_size
    narrow = build_draft_vocab(counts_for(V), 128)
    head = build_head(HeadConfig(), target, narrow.d2t_N, narrow.t2d_V)
    other = build_draft_vocab(-counts_for(V), 256)  # the rarest tokens instead
    with pytest.raises(ValueError, match="leaves out .* of the head's 128 trained tokens"):
        widened(head, target.model.get_output_embeddings().weight, other)
