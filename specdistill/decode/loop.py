"""Speculative generation on a real target: draft a tree, verify it in one target forward with tree
attention, keep the accepted path's KV, repeat (gpt-fast's plain loop, with trees and batches).

Positions: committed tokens x_0..x_{n-1} sit in both KV caches; the root x_n (the last token the
target chose) is not yet in either. The draft cache entry t is the head's step-0 input at position t:
(embedding of x_{t+1}, target features at t). A tree node at depth d sits at position n + d for the
target and n - 1 + d for the head, exactly as in the Training-Time Test.

Batches: prompts are left-padded to one length. Both caches share one slot layout and one validity
mask `valid_BL`: pad slots, and the stale slots that compaction leaves in rows that accepted fewer
tokens than the batch's longest row, are False and masked out of every later attention. A row's
committed count (its number of valid slots) is its next position. Finished rows leave the batch.

The drafters (`decode/drafters.py`) all answer `propose -> Tree`; the loop and the verifier are the same
for every one.

Shapes: B batch, L cache slots, T new tokens, K frontier, N tree nodes, S verdict slots, A aux
features, D head hidden, V target vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from specdistill.decode.kv import ReplayCache, compact_cache
from specdistill.decode.tree import Tree
from specdistill.decode.verify import GREEDY, Sampling, Verdict
from specdistill.target_runner import TargetRunner, keeps_recurrent_state, require_kv_cache, with_kv_cache


@dataclass
class GenerationStats:
    """One batch's results: per-row tokens and accepted counts, and batch-wide costs."""

    tokens: list[list[int]]
    accepted: list[list[int]]  # accepted draft tokens per verification round, per row
    hits: list[tuple[int, int, int]] = field(default_factory=list)  # (depth, tokens ranked, rank or -1)
    target_forwards: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0


class _Clock:
    """Wall time of code sections, synchronising CUDA so the split is real."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()

    def lap(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        seconds, self.t0 = now - self.t0, now
        return seconds


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    """(ids_BT, valid_BT): prompts right-aligned, pads on the left."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), T, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        valid[b, T - len(p):] = True
    return ids.to(device), valid.to(device)


def prefill_inputs(valid_BT: Tensor) -> tuple[Tensor | None, Tensor]:
    """(4D mask or None when nothing is padded, position ids) for a left-padded prompt batch. Pad
    queries see themselves, so no row of the attention is empty (an empty row gives NaN keys later)."""
    positions_BT = (valid_BT.long().cumsum(1) - 1).clamp(min=0)
    if bool(valid_BT.all()):
        return None, positions_BT
    T = valid_BT.shape[1]
    eye_TT = torch.eye(T, dtype=torch.bool, device=valid_BT.device)
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=valid_BT.device).tril()
    return ((causal_TT & valid_BT[:, None, :]) | eye_TT)[:, None], positions_BT


def _stopped(tokens: list[int], eos: set[int], max_new: int) -> bool:
    return len(tokens) >= max_new or any(t in eos for t in tokens)


def _trim(tokens: list[int], eos: set[int], max_new: int) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


def _record_hits(stats: GenerationStats, tree: Tree, verdict: Verdict, b: int) -> None:
    """Along row b's accepted path, at each expanded node: how many of the drafter's top tokens it
    ranked, and where among them the target's next token was (-1: not among them). Ranks come from
    the drafter's whole top-k at the node, not from the children the tree kept: a tree keeps fewer
    children under a confident parent, so kept-children ranks would measure wide tops only where the
    drafter was unsure. Feeds the serving-advice model."""
    if tree.child_ranked is None:
        return
    path = [n for n in verdict.accept_nodes[b].tolist() if n >= 0]
    following = verdict.tokens[b].tolist()  # the target's token after each path node
    for d, parent in enumerate(path, start=1):
        ranked = [t for t in tree.child_ranked[b, parent].tolist() if t >= 0]
        if not ranked:
            break
        token = following[d - 1]
        stats.hits.append((d, len(ranked), ranked.index(token) if token in ranked else -1))


@torch.inference_mode()
def speculative_generate(runner: TargetRunner, proposer, prompts: list[list[int]], max_new_tokens: int,
                         eos: set[int], sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
                         pad_id: int = 0) -> GenerationStats:
    """Speculative generation of a batch of prompts. Temperature 0 equals plain greedy decoding; above
    0, the committed tokens are distributed as sampling from the target."""
    model = runner.target.model
    recurrent = keeps_recurrent_state(model)
    if recurrent and len(prompts) > 1:
        require_kv_cache(model, "speculative decoding of a batch")
    device = next(model.parameters()).device
    clock = _Clock(device)
    stats = GenerationStats(tokens=[[] for _ in prompts], accepted=[[] for _ in prompts])
    cache = ReplayCache() if recurrent else DynamicCache()
    ids_BT, valid_BL = left_pad(prompts, pad_id, device)
    mask, positions = prefill_inputs(valid_BL)
    out = runner(ids_BT, attention_mask=mask, position_ids=positions, cache=cache)
    stats.target_forwards += 1
    roots_B = sampling.pick(out.logits_BTV[:, -1], generator)
    committed_B = valid_BL.sum(1)
    stats.verify_s += clock.lap()
    proposer.start(out, torch.cat([ids_BT[:, 1:], roots_B[:, None]], 1), valid_BL)
    stats.draft_s += clock.lap()
    rows = list(range(len(prompts)))  # original index of each live row
    contexts = [list(p) for p in prompts]
    new_tokens = [[int(t)] for t in roots_B]
    while True:
        for b, row in enumerate(rows):
            stats.tokens[row].extend(new_tokens[b])
            contexts[row].extend(new_tokens[b])
        keep = [b for b, row in enumerate(rows) if not _stopped(stats.tokens[row], eos, max_new_tokens)]
        if not keep:
            break
        if len(keep) < len(rows):
            keep_R = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_R)
            proposer.select_rows(keep_R)
            valid_BL, committed_B, roots_B = valid_BL[keep_R], committed_B[keep_R], roots_B[keep_R]
            rows = [rows[b] for b in keep]
        stats.verify_s += clock.lap()

        tree = proposer.propose(roots_B, [contexts[row] for row in rows], sampling, generator)
        stats.draft_s += clock.lap()
        B, N, L = tree.batch_size, tree.num_nodes, valid_BL.shape[1]
        mask = torch.cat([valid_BL[:, None].expand(B, N, L), tree.attention_mask()], dim=2)[:, None]
        out = runner(tree.tokens, attention_mask=mask, position_ids=tree.positions(committed_B), cache=cache)
        stats.target_forwards += 1
        verdict = sampling.verify(tree, out.logits_BTV, generator)
        compact_cache(cache, L, verdict.accept_nodes, verdict.accept_len)
        S = int(verdict.accept_len.max()) + 1
        new_valid_BS = torch.arange(S, device=device) <= verdict.accept_len[:, None]
        valid_BL = torch.cat([valid_BL, new_valid_BS], 1)
        stats.verify_s += clock.lap()
        proposer.commit(out, verdict, committed_B, new_valid_BS)
        stats.draft_s += clock.lap()
        committed_B = committed_B + verdict.accept_len + 1
        roots_B = verdict.tokens.gather(1, verdict.accept_len[:, None])[:, 0]
        lengths = (verdict.accept_len + 1).tolist()
        new_tokens = [t[:n] for t, n in zip(verdict.tokens.tolist(), lengths)]
        for b, row in enumerate(rows):
            stats.accepted[row].append(lengths[b] - 1)
            _record_hits(stats, tree, verdict, b)
    stats.tokens = [_trim(t, eos, max_new_tokens) for t in stats.tokens]
    return stats


@torch.inference_mode()
def plain_generate(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                   sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
                   pad_id: int = 0) -> list[list[int]]:
    """Plain decoding with a KV cache, one token per forward: the baseline for speed and, at
    temperature 0, the reference for the lossless check."""
    require_kv_cache(model, "plain decoding")
    device = next(model.parameters()).device
    cache = DynamicCache()
    ids_BT, valid_BL = left_pad(prompts, pad_id, device)
    mask, positions_BT = prefill_inputs(valid_BL)
    logits_BV = model(ids_BT, attention_mask=mask, position_ids=positions_BT, **with_kv_cache(model, cache),
                      logits_to_keep=1).logits[:, -1]
    committed_B = valid_BL.sum(1)
    tokens: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))
    padded = mask is not None
    while True:
        next_B = sampling.pick(logits_BV, generator)
        for b, row in enumerate(rows):
            tokens[row].append(int(next_B[b]))
        keep = [b for b, row in enumerate(rows) if not _stopped(tokens[row], eos, max_new_tokens)]
        if not keep:
            break
        if len(keep) < len(rows):
            keep_R = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_R)
            valid_BL, committed_B, next_B = valid_BL[keep_R], committed_B[keep_R], next_B[keep_R]
            rows = [rows[b] for b in keep]
        valid_BL = torch.cat([valid_BL, torch.ones_like(valid_BL[:, :1])], 1)
        mask = valid_BL[:, None, None] if padded else None
        logits_BV = model(next_B[:, None], attention_mask=mask, position_ids=committed_B[:, None],
                          **with_kv_cache(model, cache)).logits[:, -1]
        committed_B = committed_B + 1
    return [_trim(t, eos, max_new_tokens) for t in tokens]
