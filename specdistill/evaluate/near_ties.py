"""Evidence for a float32 count that differs on one prompt: was it an argmax near-tie, or the export read wrongly?

Two float32 kernels (the engine's and torch's) round differently, so a draft whose top two logits lie closer than
their disagreement can flip. How close is close is measured, not chosen: the engine's plain run returns the
target's top-2 log-probs at every token it generated, our target computes the same positions, and the largest
difference between the two top-2 margins is `epsilon` (the target's; the head runs the same kernels on the target's
features). A prompt's difference is a near-tie only when replaying it with one draft whose margin is below epsilon
turned to its runner-up reproduces the engine's counts exactly; anything else is read differently (a flip above
epsilon that reproduces them is named, as the evidence of what moved).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specdistill.decode.drafters import chain_proposer
from specdistill.decode.loop import speculative_generate
from specdistill.decode.tree import chain_tree
from specdistill.decode.verify import GREEDY
from specdistill.target import Target
from specdistill.target_runner import TargetRunner

MAX_REPLAYS = 8  # flips below epsilon tried per prompt, the smallest margins first (a near-tie is rare)
NAMED_CLOSEST = 3  # closest calls tried in any case, to name a flip that reproduces the engine above epsilon


def top2_margin(logprobs_V: Tensor) -> float:
    """Log-prob of the first choice minus the second's (the logit gap: softmax keeps differences)."""
    first, second = logprobs_V.float().topk(2).values.tolist()
    return first - second


def runner_up_first(logprobs_BKV: Tensor) -> Tensor:
    """The same log-probs with the first and second choices' values swapped, so an argmax takes the runner-up."""
    out = logprobs_BKV.clone()
    top = out.topk(2, dim=-1)
    out.scatter_(-1, top.indices, top.values.flip(-1))
    return out


class ProbedChain:
    """A greedy chain proposer (`drafters.chain_proposer`) for one prompt that records each draft's top-2 margin as
    (round, position, margin) and, given `flip=(round, position)`, drafts the runner-up there."""

    def __init__(self, chain, flip: tuple[int, int] | None = None):
        self.chain, self.flip, self.round, self.margins = chain, flip, -1, []
        self.start, self.commit, self.select_rows = chain.start, chain.commit, chain.select_rows

    def _probe(self, logprobs_BKV: Tensor, position: int) -> Tensor:
        self.margins.append((self.round, position, top2_margin(logprobs_BKV[0, 0])))
        return runner_up_first(logprobs_BKV) if self.flip == (self.round, position) else logprobs_BKV

    def propose(self, roots_B, contexts, sampling, generator):
        if roots_B.shape[0] != 1 or sampling.temperature > 0:
            raise ValueError("ProbedChain replays one prompt, greedily")
        self.round += 1
        root_logp_BV, step = self.chain.chain_parts(roots_B)
        root = self._probe(root_logp_BV[:, None], 0)[:, 0]
        return chain_tree(roots_B, root, lambda tokens, parent, depth: self._probe(step(tokens, parent, depth), depth),
                          self.chain.depth)


def replay(target: Target, head, prompt: list[int], k: int, max_new_tokens: int,
           flip: tuple[int, int] | None = None) -> tuple[list[int], list[tuple[int, int, float]]]:
    """One prompt's accepted drafts per round and every draft's (round, position, margin)."""
    proposer = ProbedChain(chain_proposer(head, target.vocab_size, k), flip)
    stats = speculative_generate(TargetRunner(target), proposer, [prompt], max_new_tokens, target.eos_ids, GREEDY,
                                 None, target.tokenizer.pad_token_id)
    return stats.accepted[0], proposer.margins


def explain(target: Target, head, prompt: list[int], k: int, max_new_tokens: int, engine_counters: dict,
            epsilon: float, counters_of) -> dict:
    """Why one prompt's engine counters are not ours. Its closest calls are replayed flipped, one at a time,
    smallest margin first: a near-tie is a flip below `epsilon` that reproduces the engine's counts. A flip that
    reproduces them above epsilon is named too (the engine's draft disagrees with ours by more than the target's
    kernels do), and is not a near-tie."""
    _, margins = replay(target, head, prompt, k, max_new_tokens)
    below = sum(m < epsilon for _, _, m in margins)
    closest = sorted((m, r, p) for r, p, m in margins)[:max(NAMED_CLOSEST, min(below, MAX_REPLAYS))]
    for margin, round_, position in closest:
        rounds, _ = replay(target, head, prompt, k, max_new_tokens, flip=(round_, position))
        if counters_of(rounds) == engine_counters:
            return {"near_tie": margin < epsilon, "round": round_, "position": position, "margin": margin}
    return {"near_tie": False, "smallest_margin": closest[0][0] if closest else None, "flips_tried": len(closest)}


@torch.inference_mode()
def kernel_margin_gap(target: Target, prompts: list[list[int]], engine_top2: list[list[list[list[float]]]]) -> float:
    """The largest difference between the engine's and our target's top-2 margin along the engine's greedy outputs
    (its first choice at each position), where both rank the same two tokens: how far two float32 kernels disagree
    on a margin here."""
    gap = 0.0
    device = next(target.model.parameters()).device
    for prompt, top2 in zip(prompts, engine_top2):
        output = [int(position[0][0]) for position in top2]
        if not output:
            continue
        ids = torch.tensor([prompt + output[:-1]], device=device)
        logprobs = target.model(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
        ours = logprobs.topk(2, dim=-1)
        for j, ranked in enumerate(top2):
            if [token for token, _ in ranked] == ours.indices[j].tolist():
                (_, first), (_, second) = ranked
                gap = max(gap, abs((first - second) - float(ours.values[j, 0] - ours.values[j, 1])))
    return gap
