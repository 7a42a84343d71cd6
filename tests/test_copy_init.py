"""The copy initialisation makes a fresh EAGLE-3 head copy from its context before any training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from specdistill.capture.online import capture_batch
from specdistill.config import HeadConfig
from specdistill.heads.build import build_head
from specdistill.heads.copy_init import init_copy_attention
from specdistill.target import Target
from specdistill.target_runner import TargetRunner

VOCAB, HALF = 256, 48


def tiny_target() -> Target:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, name="tiny-copy", revision=None, layer_ids=(1, 2, 4))


def repeated_samples(target: Target, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Random tokens, then the same tokens again: the second half is a verbatim copy of the first."""
    g = torch.Generator().manual_seed(seed)
    half_BT = torch.stack([torch.randperm(VOCAB, generator=g)[:HALF] for _ in range(n)])
    ids_BT = torch.cat([half_BT, half_BT], dim=1)
    feats = capture_batch(TargetRunner(target), ids_BT, torch.ones_like(ids_BT), "last", None)
    return [{"input_ids": ids_BT[b], "aux": feats["aux"][b]} for b in range(n)]


def copy_accuracy(head, sample) -> float:
    """Depth-0 top-1 on the copied half: the step at t is given x[t+1] and should answer x[t+2]."""
    x = sample["input_ids"]
    T = len(x)
    attn = head.midlayer.self_attn

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, attn.expand_kv(k), attn.expand_kv(v), is_causal=True)

    with torch.no_grad():
        hidden = head.initial_hidden(sample["aux"][None].float())
        out = head.step(torch.cat([x[1:], x[-1:]])[None], hidden, torch.arange(T)[None], causal)
        top1 = head.draft_to_target(head.logits(out)[0].argmax(-1))
    t = torch.arange(HALF, T - 2)
    return float((top1[t] == x[t + 2]).float().mean())


def test_a_fresh_head_copies_after_the_copy_initialisation():
    target = tiny_target()
    d2t, t2d = torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool)
    held_out = repeated_samples(target, 1, seed=2)[0]
    fitted_on = repeated_samples(target, 8, seed=1)
    heads = []
    for _ in range(2):
        torch.manual_seed(1)
        heads.append(build_head(HeadConfig(), target, d2t, t2d))
    sharp, default = heads
    before = copy_accuracy(sharp, held_out)
    # a sharp match shows the mechanism: the copied token wins outright
    fit_r2 = init_copy_attention(sharp, fitted_on, match_scale=2.0)
    sharp_accuracy = copy_accuracy(sharp, held_out)
    assert fit_r2 > 0.9
    assert before < 0.1 and sharp_accuracy > 0.7, (before, sharp_accuracy)  # rotary's fast pairs in the match: ~0.35
    # the default start is soft (training sharpens it), yet already copies far above chance
    init_copy_attention(default, fitted_on)
    assert 0.15 < copy_accuracy(default, held_out) < sharp_accuracy


def test_copy_initialisation_needs_an_eagle3_head_as_wide_as_the_target():
    target = tiny_target()
    d2t, t2d = torch.zeros(VOCAB, dtype=torch.long), torch.ones(VOCAB, dtype=torch.bool)
    narrow = HeadConfig(hidden_size=32, num_attention_heads=2, head_dim=16, freeze_lm_head=False)
    head = build_head(narrow, target, d2t, t2d)
    with pytest.raises(ValueError, match="head.copy_init"):
        init_copy_attention(head, repeated_samples(target, 2, seed=1))
