"""DFlash heads: the block objective trains what the drafter serves (packed documents, padding), learns, and drafts
losslessly on a real (tiny random) target; both export layouts read back and carry the engines' conventions."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specdistill.config import HeadConfig, TargetConfig
from specdistill.decode.drafters import BlockProposer, chain_proposer
from specdistill.decode.loop import plain_generate, speculative_generate
from specdistill.decode.verify import GREEDY
from specdistill.export import common, export_dflash
from specdistill.export.common import ExportError
from specdistill.export.dflash import LAYOUTS
from specdistill.export.reader import detect_layout, read_head
from specdistill.heads.build import build_head
from specdistill.heads.dflash import DFlashHead, dense_attention
from specdistill.target import load_target
from specdistill.target_runner import TargetOutput, TargetRunner
from specdistill.train.block import unroll_block
from specdistill.train.loss import LOSSES
from tests.test_ttt import random_batch, random_teacher, tiny_head

VOCAB, DRAFT, STEPS = 96, 48, 3


def tiny_dflash(num_layers=2) -> DFlashHead:
    return tiny_head("dflash", VOCAB, DRAFT, num_layers=num_layers)


def recorded_block(head, batch):
    """The logits `unroll_block` trains at each mask slot, one [M, V] per slot (anchors in row-major order)."""
    per_slot = []

    def record(logits, target):
        per_slot.append(logits.detach()[0])
        return LOSSES["forward_kl"](logits, target)

    with torch.no_grad():
        unroll_block(head, batch, random_teacher(*batch.input_ids_BT.shape, head), STEPS, 0.8, record)
    return per_slot


def served_block(head, aux_TA, bonus: int) -> torch.Tensor:
    """The drafter's slot log-probs (over the draft vocabulary) for a context of aux rows and a bonus token."""
    proposer = BlockProposer(head, VOCAB, STEPS)
    proposer.start(TargetOutput(aux_TA[None], None, None), None, torch.ones(1, len(aux_TA), dtype=torch.bool))
    tree = proposer.propose(torch.tensor([bonus]), [], GREEDY, None)
    assert tree.tokens.shape == (1, STEPS + 1)
    draft_ids = head.draft_to_target(torch.arange(DRAFT))
    with torch.inference_mode():
        W = STEPS + 1
        mask = torch.cat([proposer.valid_BL[:, None].expand(1, W, -1), torch.ones(1, W, W, dtype=torch.bool)], 2)
        hidden = head.block(head.block_input(torch.tensor([bonus]), W), len(aux_TA) + torch.arange(W)[None],
                            proposer.kv, dense_attention(mask))
        return torch.log_softmax(head.logits(hidden[0, 1:]), -1), tree.tokens[0, 1:], draft_ids


def test_block_objective_trains_what_the_drafter_serves_across_documents_and_padding():
    """Row 0 packs two documents (positions restart at 6), row 1 is padded after 9: each anchor's slots in training
    equal the drafter's block over that anchor's own document before it."""
    head = tiny_dflash().eval()
    B, T = 2, 12
    batch = random_batch(B, T, head)
    batch.doc_BT = torch.tensor([[0] * 6 + [1] * 6, [0] * 9 + [-1] * 3])
    batch.position_ids_BT = torch.tensor([list(range(6)) + list(range(6)), list(range(9)) + [0] * 3])
    batch.valid_BT = batch.doc_BT >= 0
    batch.loss_mask_BT = batch.valid_BT.long()
    batch.loss_mask_BT[1, :3] = 0  # a prompt: no anchor before position 2
    per_slot = recorded_block(head, batch)
    doc_start = {0: [0] * 6 + [6] * 6, 1: [0] * 9}
    anchors = [(b, a) for b in range(B) for a in range(T - 1)
               if batch.valid_BT[b, a + 1] and batch.doc_BT[b, a + 1] == batch.doc_BT[b, a] and batch.loss_mask_BT[b, a + 1]]
    assert (1, 1) not in anchors and (0, 5) not in anchors and (1, 8) not in anchors
    seen = [0] * STEPS
    for b, a in anchors:
        start = doc_start[b][a]
        logp, _, _ = served_block(head, batch.aux_BTA[b, start:a], int(batch.input_ids_BT[b, a]))
        for k in range(1, STEPS + 1):
            end = start + (6 if b == 0 else 9)
            if a + k < end and batch.loss_mask_BT[b, a + k]:
                torch.testing.assert_close(torch.log_softmax(per_slot[k - 1][seen[k - 1]], -1), logp[k - 1],
                                           atol=1e-5, rtol=1e-5)
                seen[k - 1] += 1
    assert seen == [len(s) for s in per_slot] and seen[0] == len(anchors)


def test_the_block_sees_its_later_slots_and_not_a_causal_mask():
    """vLLM serves a DFlash config without `causal` with non-causal attention: the first mask slot reads the later
    ones. A causal block (the fault) drafts other logits (with one layer, all but the last slot's)."""
    head = tiny_dflash(num_layers=1).eval()
    aux = torch.randn(5, 96)
    logp, _, _ = served_block(head, aux, 7)
    with torch.inference_mode():
        proposer = BlockProposer(head, VOCAB, STEPS)
        proposer.start(TargetOutput(aux[None], None, None), None, torch.ones(1, 5, dtype=torch.bool))
        W = STEPS + 1
        causal = torch.cat([torch.ones(1, W, 5, dtype=torch.bool), torch.ones(W, W, dtype=torch.bool).tril()[None]], 2)
        hidden = head.block(head.block_input(torch.tensor([7]), W), 5 + torch.arange(W)[None], proposer.kv,
                            dense_attention(causal))
        causal_logp = torch.log_softmax(head.logits(hidden[0, 1:]), -1)
    assert not torch.allclose(causal_logp[0], logp[0], atol=1e-3)
    torch.testing.assert_close(causal_logp[-1], logp[-1], atol=1e-5, rtol=1e-5)  # the last slot sees all either way


@pytest.mark.parametrize("loss", list(LOSSES))
def test_block_objective_learns_a_fixed_batch(loss):
    head = tiny_dflash()
    batch, teacher = random_batch(2, 12, head), random_teacher(2, 12, head)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(60):
        r = unroll_block(head, batch, teacher, STEPS, 0.8, LOSSES[loss])
        opt.zero_grad()
        r.loss.backward()
        opt.step()
        first = first if first is not None else float(r.loss.detach())
    assert float(r.loss.detach()) < 0.5 * first, (loss, first, float(r.loss.detach()))
    assert r.step_count.tolist() == [2 * (12 - k) for k in range(1, STEPS + 1)]
    assert head.embed_tokens.weight.grad is None  # the target embedding (so the mask token's) stays frozen


@pytest.mark.parametrize("batch_size", [1, 3])
def test_block_drafting_equals_greedy_decoding(batch_size):
    target = load_target(TargetConfig(name="random"))
    prompts = [target.prompt_ids(t) for t in ["Tell me a story about a dragon", "2+2=", "Write a poem about the sea"]]
    reference = [plain_generate(target.model, [p], 16, target.eos_ids)[0] for p in prompts]
    ids = torch.tensor(sorted({t for r in reference for t in r} | {0, 1, 2}))
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(0)
    head = build_head(HeadConfig(kind="dflash", copy_init=False), target, ids - torch.arange(len(ids)), t2d, 4).eval()
    proposer = chain_proposer(head, target.vocab_size, 3)
    assert isinstance(proposer, BlockProposer)
    tokens = []
    for i in range(0, len(prompts), batch_size):
        stats = speculative_generate(TargetRunner(target), proposer, prompts[i: i + batch_size], 16, target.eos_ids,
                                     GREEDY)
        tokens += stats.tokens
    assert tokens == reference
    with pytest.raises(ValueError, match="drafts 1 to 3 tokens a round, not 4"):
        BlockProposer(head, target.vocab_size, 4)
    with pytest.raises(ValueError, match="needs its block size"):
        build_head(HeadConfig(kind="dflash"), target, ids - torch.arange(len(ids)), t2d)


@pytest.mark.parametrize("fmt", LAYOUTS)
def test_an_export_reads_back_to_the_same_head_with_the_engines_conventions(fmt, tmp_path):
    head = tiny_dflash()
    out = export_dflash(head, fmt, tmp_path / fmt, "float32", target="a-verifier")
    config = json.loads((out / common.CONFIG_FILE).read_text())
    tensors = load_file(str(out / common.WEIGHTS_FILE))
    assert detect_layout(config) == fmt
    if fmt == "vllm":  # layer outputs, as the DFlash config counts them; no causal flag: vLLM serves it non-causally
        assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
        assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 2, 3]}
        assert "t2d" not in tensors and "causal" not in config and "layer_types" not in config
    else:  # layer inputs, as speculators counts them; a false non-causal flag would make vLLM serve it causally
        assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [2, 3, 4]
        assert config["sliding_window_non_causal"] is True and config["mask_token_id"] == VOCAB - 1
    assert tensors["d2t"].dtype == torch.int64 and "layers.1.self_attn.k_norm.weight" in tensors
    back = read_head(out)
    assert back.config == head.config
    for key, value in head.trainable_state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


def test_exports_a_dflash_head_cannot_take_are_refused_before_writing(tmp_path):
    head = tiny_dflash()
    with pytest.raises(ExportError, match="does not fit a DFlash head"):
        export_dflash(head, "sglang", tmp_path / "sglang")
    with pytest.raises(ExportError, match="drafts 1 to 3"):
        export_dflash(head, "vllm", tmp_path / "vllm", speculative_tokens=4)
    with pytest.raises(ExportError, match="no verifier"):
        export_dflash(head, "speculators", tmp_path / "speculators")
    assert not list(tmp_path.iterdir())
