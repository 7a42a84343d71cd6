"""The near-tie evidence of the engine check, on a real (random) target and head: a replay with one draft turned to
its runner-up reproduces counts that moved, only below the epsilon given, and epsilon is measured from two sets of
top-2 log-probs."""

import pytest
import torch

from specdistill.decode.loop import plain_generate
from specdistill.evaluate.counters import chain_counters
from specdistill.evaluate.near_ties import (
    MAX_REPLAYS,
    explain,
    kernel_margin_gap,
    replay,
    runner_up_first,
    top2_margin,
)
from tests.test_decode import MAX_NEW, head_for, setup  # noqa: F401 (the module fixture)

K = 3


def test_runner_up_first_swaps_only_the_two_best():
    logprobs = torch.tensor([[[-3.0, -0.5, -1.0, -2.0]]])
    assert runner_up_first(logprobs).tolist() == [[[-3.0, -1.0, -0.5, -2.0]]]
    assert top2_margin(logprobs[0, 0]) == pytest.approx(0.5)


def test_a_flip_below_epsilon_explains_moved_counts_and_one_above_does_not(setup):  # noqa: F811
    target, _, prompts, reference = setup
    head = head_for(target, "eagle3", reference)
    counters_of = lambda accepted: chain_counters(accepted, K)  # noqa: E731
    # the closest call whose runner-up changes what the target accepts (explain tries the closest calls first)
    for prompt in prompts:
        base, margins = replay(target, head, prompt, K, MAX_NEW)
        closest = sorted((m, r, p) for r, p, m in margins)[:MAX_REPLAYS]
        moving = next((f for f in closest if counters_of(replay(target, head, prompt, K, MAX_NEW, f[1:])[0])
                       != counters_of(base)), None)
        if moving:
            break
    else:
        pytest.fail("no close call's runner-up moves the counts on these prompts: nothing to explain")
    margin, round_, position = moving
    moved, _ = replay(target, head, prompt, K, MAX_NEW, flip=(round_, position))
    found = explain(target, head, prompt, K, MAX_NEW, counters_of(moved), margin * 1.001 + 1e-12, counters_of)
    assert found["near_tie"] and found["margin"] <= margin * 1.001 + 1e-12
    missed = explain(target, head, prompt, K, MAX_NEW, counters_of(moved), margin * 0.999, counters_of)
    # above epsilon it is no near-tie, though the flip that reproduces the counts is named when tried
    assert not missed["near_tie"] and missed.get("margin", margin) == margin


def test_epsilon_is_the_largest_gap_between_two_kernels_top2_margins(setup):  # noqa: F811
    target, _, prompts, _ = setup
    prompt = prompts[0]
    output = plain_generate(target.model, [prompt], MAX_NEW, target.eos_ids)[0]
    with torch.inference_mode():
        logprobs = target.model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:].log_softmax(-1)
    top = logprobs.topk(2, dim=-1)
    top2 = [[[int(i), float(v)] for i, v in zip(ids, values)] for ids, values in zip(top.indices, top.values)]
    assert kernel_margin_gap(target, [prompt], [top2]) < 1e-5  # the same kernel: no gap beyond float32 rounding
    top2[3][1][1] -= 1e-3  # the runner-up 1e-3 lower at one position: that margin 1e-3 wider
    assert kernel_margin_gap(target, [prompt], [top2]) == pytest.approx(1e-3, rel=1e-2)
    top2[-1] = [top2[-1][1], top2[-1][0]]  # the last token ranked the other way round: not a margin of ours, skipped
    assert kernel_margin_gap(target, [prompt], [top2]) == pytest.approx(1e-3, rel=1e-2)
