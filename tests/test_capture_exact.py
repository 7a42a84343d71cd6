"""Captured features equal what transformers computes: layer outputs, the pre-norm last state, the teacher.

Legend: B batch, T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_capture_store import LENGTHS, make_samples, small_cfg

from specdistill.capture import run as capture_run
from specdistill.capture.online import capture_batch
from specdistill.capture.store import FeatureStore
from specdistill.config import TargetConfig
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget
from specdistill.target import Target, load_target
from specdistill.target_runner import TargetRunner

FAMILIES = ["Llama", "Qwen2", "Qwen3", "Mistral", "Gemma"]
LAYER_IDS = (1, 3, 4)


def tiny_target(family: str) -> Target:
    config = getattr(transformers, f"{family}Config")(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, name=f"tiny-{family}", revision=None, layer_ids=LAYER_IDS)


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    input_ids_BT = torch.randint(0, vocab, (3, 11))
    attention_mask_BT = torch.ones_like(input_ids_BT)
    attention_mask_BT[1, 7:] = 0
    attention_mask_BT[2, 4:] = 0
    return input_ids_BT, attention_mask_BT


def reference(target: Target, input_ids_BT, attention_mask_BT):
    """transformers' own hidden states, and the final norm's input recorded by a pre-hook."""
    seen = {}
    norm = target.model.get_decoder().norm
    handle = norm.register_forward_pre_hook(lambda _m, args: seen.setdefault("pre_norm", args[0]))
    try:
        with torch.inference_mode():
            out = target.model(
                input_ids=input_ids_BT, attention_mask=attention_mask_BT, output_hidden_states=True
            )
    finally:
        handle.remove()
    return out, seen["pre_norm"]


@pytest.mark.parametrize("family", FAMILIES)
def test_runner_equals_output_hidden_states(family):
    target = tiny_target(family)
    input_ids_BT, attention_mask_BT = padded_batch(target.vocab_size)
    out = TargetRunner(target)(input_ids_BT, attention_mask_BT)
    ref, pre_norm_BTH = reference(target, input_ids_BT, attention_mask_BT)
    H = target.hidden_size
    for k, i in enumerate(LAYER_IDS):
        assert torch.equal(out.aux_BTA[..., k * H : (k + 1) * H], ref.hidden_states[i + 1]), f"layer {i}"
    assert torch.equal(out.last_BTH, pre_norm_BTH)
    assert not torch.allclose(out.last_BTH, ref.hidden_states[-1])  # that entry is after the final norm
    assert torch.equal(out.logits_BTV, ref.logits)


def test_capture_batch_topk_is_the_full_vocab_log_softmax():
    target = tiny_target("Llama")
    input_ids_BT, attention_mask_BT = padded_batch(target.vocab_size)
    feats = capture_batch(
        TargetRunner(target), input_ids_BT, attention_mask_BT, teacher="topk", teacher_topk=5
    )
    ref, _ = reference(target, input_ids_BT, attention_mask_BT)
    top = ref.logits.float().log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(feats["topk_ids"], top.indices.to(torch.int32))
    torch.testing.assert_close(feats["topk_logprobs"], top.values, rtol=0, atol=1e-6)
    assert feats["aux"].shape == (3, 11, 3 * target.hidden_size) and "last" not in feats
    with pytest.raises(ValueError, match="teacher_topk=97"):
        capture_batch(TargetRunner(target), input_ids_BT, attention_mask_BT, teacher="topk", teacher_topk=97)


@pytest.mark.parametrize("batch_tokens, exact", [(1, True), (256, False)])
def test_store_sample_equals_a_forward_of_that_sample(tmp_path, batch_tokens, exact):
    """batch_tokens=1: one sample per forward, so bit-exact; larger: padded batches, fp32 rounding."""
    cfg = small_cfg(tmp_path, dtype="float32", batch_tokens=batch_tokens)
    rows = make_samples(cfg, LENGTHS[:6])
    lazy = LazyTarget(cfg.target)
    store = FeatureStore(capture_run.run(cfg, RunLayout.of(cfg, "capture"), lazy)["features"])
    target = lazy.get()
    H = target.hidden_size
    for i, src in enumerate(store.source_indices):
        s = store.sample(i)
        ref, pre_norm = reference(target, torch.tensor([rows[src]["input_ids"]]), None)
        expected_aux = torch.cat([ref.hidden_states[j + 1][0] for j in target.layer_ids], dim=-1)
        if exact:
            assert torch.equal(s["aux"], expected_aux) and torch.equal(s["last"], pre_norm[0])
        else:
            torch.testing.assert_close(s["aux"], expected_aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(s["last"], pre_norm[0], rtol=1e-5, atol=1e-5)
        assert s["aux"].shape == (LENGTHS[src], 3 * H)


@pytest.mark.slow
def test_embedded_target_capture_is_exact():
    target = load_target(TargetConfig())
    enc = target.tokenizer.apply_chat_template(
        [
            [{"role": "user", "content": "What is the capital of France?"}],
            [{"role": "user", "content": "Write a haiku about speculative decoding and draft heads."}],
        ],
        add_generation_prompt=True,
        padding=True,
        return_dict=True,
        return_tensors="pt",
    )
    input_ids_BT, attention_mask_BT = enc["input_ids"], enc["attention_mask"]
    assert target.layer_ids == (1, 14, 26)
    out = TargetRunner(target)(input_ids_BT, attention_mask_BT)
    ref, pre_norm_BTH = reference(target, input_ids_BT, attention_mask_BT)
    H = target.hidden_size
    for k, i in enumerate(target.layer_ids):
        assert torch.equal(out.aux_BTA[..., k * H : (k + 1) * H], ref.hidden_states[i + 1]), f"layer {i}"
    assert torch.equal(out.last_BTH, pre_norm_BTH)
    assert torch.equal(out.logits_BTV, ref.logits)
