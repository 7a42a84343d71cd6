"""Our chain replayed along the engine's own output, the bfloat16 engine check's yardstick.

In bfloat16 the engine's and our greedy decodes part ways by rounding, so two free-running decodes answer with
different texts and their taus differ by far more than any export fault worth finding at a small size. Here our
target's verdict at each position is forced to the token the engine committed there; its features are its own at
those tokens. Our head then drafts at the very contexts the engine's drafts saw, and what still moves a count is the
head's rounding: a draft whose top two logits bfloat16 cannot keep apart. A correct export stays within a few percent
of this replay (`scripts/bf16_spread.py` measures how far), a fault that costs tau falls below it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill.decode.drafters import chain_proposer
from specdistill.decode.loop import speculative_generate
from specdistill.decode.verify import GREEDY
from specdistill.engines import EngineError
from specdistill.evaluate.counters import chain_counters, tau_of
from specdistill.target import Target
from specdistill.target_runner import TargetOutput, TargetRunner

# bfloat16: how far a correct export's tau strays from our replay along its outputs, measured per prompt set
# (scripts/bf16_spread.py writes the file with its command).
BF16_SPREAD_FILE = Path(__file__).with_name("bf16_spread.json")


class ForcedRunner(TargetRunner):
    """The target on one sequence (prompt and engine output) whose logits at position p single out the token at
    p + 1: greedy verification commits the sequence whatever the target would have chosen. Past its end the
    target's own logits stand."""

    def __init__(self, target: Target, sequence: list[int]):
        super().__init__(target)
        self.sequence = torch.tensor(sequence, device=next(target.model.parameters()).device)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                 with_logits: bool = True) -> TargetOutput:
        out = super().__call__(input_ids, attention_mask, position_ids, cache, with_logits)
        if out.logits_BTV is None:
            return out
        following_BT = position_ids + 1
        inside_BT = following_BT < len(self.sequence)
        tokens_BT = self.sequence[following_BT.clamp(max=len(self.sequence) - 1)]
        forced_BTV = torch.full_like(out.logits_BTV, float("-inf")).scatter_(-1, tokens_BT[..., None], 0.0)
        return dataclasses.replace(out, logits_BTV=torch.where(inside_BT[..., None], forced_BTV, out.logits_BTV))


def chain_along(target: Target, head, prompts: list[list[int]], outputs: list[list[int]], k: int,
                max_new_tokens: int) -> list[list[int]]:
    """Each prompt's accepted drafts per round, our chain of `k` drafting along the engine's output for it."""
    rounds = []
    for prompt, output in tqdm(list(zip(prompts, outputs)), desc=f"our chain of {k} along the engine's outputs",
                               unit="prompt"):
        proposer = chain_proposer(head, target.vocab_size, k)
        stats = speculative_generate(ForcedRunner(target, prompt + output), proposer, [prompt], max_new_tokens,
                                     target.eos_ids, GREEDY)  # one prompt: nothing padded
        if stats.tokens[0] != output:  # the engine stopped where our target's end-of-turn ids do not, or the reverse
            raise EngineError(f"our chain could not follow the engine's output for prompt {len(rounds)}: the replay "
                              f"left it at token {first_difference(stats.tokens[0], output)} of {len(output)} (an "
                              f"end-of-turn id one side stops at: ours are {sorted(target.eos_ids)})")
        rounds.append(stats.accepted[0])
    return rounds


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def replayed_counters(target: Target, head, prompts: list[list[int]], outputs: list[list[int]], k: int,
                      max_new_tokens: int) -> dict:
    """Our chain's counters drafting along the engine's `outputs`, in all and per prompt."""
    rounds = chain_along(target, head, prompts, outputs, k, max_new_tokens)
    counters = chain_counters([a for row in rounds for a in row], k)
    return {**counters, "tau": tau_of(counters), "per_prompt": [chain_counters(row, k) for row in rounds]}


def bf16_spread() -> dict | None:
    """The measured spread (`scripts/bf16_spread.py`), or None where it was never measured."""
    return json.loads(BF16_SPREAD_FILE.read_text()) if BF16_SPREAD_FILE.exists() else None


def replay_bound(drafts: int) -> tuple[float, float] | None:
    """(bound, spread) of |engine tau / replay tau - 1| for a check of `drafts` drafts: the measured ones, per set of
    the spread's size, scaled as 1 / sqrt(drafts) (a flipped near-tie is a rare, independent event); None where the
    spread was never measured."""
    if (spread := bf16_spread()) is None or not drafts:
        return None
    scale = (spread["drafts_per_set"] / drafts) ** 0.5
    return spread["limit"] * scale, spread["rms"] * scale


def detectable_tau_loss(drafts: int) -> float | None:
    """The share of tau an export can lose and still be flagged 19 times in 20 by a check of `drafts` drafts: the
    bound plus 1.645 measured spreads."""
    bound = replay_bound(drafts)
    return None if bound is None else bound[0] + 1.645 * bound[1]
