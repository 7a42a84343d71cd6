"""Draft trees: growing them from a draft head's step outputs, and describing them to a target.

A `Tree` holds B trees of N nodes each. Node 0 is the root: the last committed token, not yet in the
target's KV cache. Parents precede children, so node order is a valid topological order and each
node's children, in index order, are its candidates in the order a verifier tries them.

Three ways to grow one, all driven by the same `step_fn` (see `StepFn`):
- `grow_dynamic_tree`: EAGLE-2. Top-K children per frontier node, scored by cumulative draft
  log-probability, the best K expanded at each depth, the best `num_nodes` of all kept.
- `static_tree`: a fixed branching per depth, e.g. [2, 2, 1, 1]; `chain_tree` is branching [1] * depth.
  With `sample=True` children are drawn from the draft distribution (without replacement) instead
  of taken top-k, which is what lossless multi-candidate rejection sampling needs (see verify.py).

Shape legend: B batch rows, N nodes, V vocabulary, K frontier width, C children per frontier node,
W ranked tokens per node.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specdistill.decode import kernels

log = logging.getLogger(__name__)

StepFn = Callable[[Tensor, Tensor, int], Tensor]
"""step_fn(frontier_tokens_BK, frontier_parent_BK, depth) -> logprobs_BKV.

frontier_tokens_BK: target-vocabulary ids of the nodes to expand. frontier_parent_BK: each one's
parent as an index into the previous call's frontier (-1 on the first call: a child of the root).
depth: the frontier nodes' depth (1 on the first call). Returns the log-probabilities of each
frontier node's children. The draft head keeps its own KV for earlier frontiers; frontier_parent is
what it needs for its ancestor mask. K may differ between calls for static trees."""


@dataclass
class TreeTensors:
    """What a target forward and a verifier need, built in one kernel call (see kernels.build_tree_tensors)."""

    mask_BNN: Tensor  # bool, row i = ancestors of i plus i
    next_token_BN: Tensor  # first (lowest-indexed) child, -1 for none
    next_sibling_BN: Tensor  # next higher-indexed child of the same parent, -1 for none


@dataclass
class Tree:
    """A batch of B draft trees of N nodes each; node 0 is the root (the last committed token)."""

    tokens: Tensor  # [B, N] target-vocabulary ids
    parents: Tensor  # [B, N] parent node index, -1 for the root; parents[b, i] < i
    depths: Tensor  # [B, N] root = 0
    scores: Tensor  # [B, N] cumulative draft log-probability, root 0
    child_probs: Tensor | None = None  # [B, N, V] draft q that node i's children were drawn from; 0 if unexpanded
    sampled: bool = False  # children were drawn from child_probs (not taken top-k): see verify.verify_rejection
    # [B, N, W] the drafter's top-W tokens at node i, best first, whether kept as children or not; -1 where
    # node i was not expanded. The serving advice measures the drafter's coverage from it.
    child_ranked: Tensor | None = None

    def __post_init__(self) -> None:
        B, N = self.tokens.shape
        for name in ("parents", "depths", "scores"):
            if tuple(getattr(self, name).shape) != (B, N):
                raise ValueError(f"Tree.{name}: expected shape {(B, N)} like tokens, got {tuple(getattr(self, name).shape)}")
        if self.child_probs is not None and tuple(self.child_probs.shape[:2]) != (B, N):
            raise ValueError(f"Tree.child_probs: expected shape ({B}, {N}, V), got {tuple(self.child_probs.shape)}")
        idx_N = torch.arange(N, device=self.parents.device)
        if not bool((self.parents[:, 0] == -1).all()):
            raise ValueError("Tree.parents: node 0 is the root and must have parent -1")
        bad = (self.parents[:, 1:] < 0) | (self.parents[:, 1:] >= idx_N[1:])
        if bool(bad.any()):
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"Tree.parents[{b}, {i + 1}] = {int(self.parents[b, i + 1])}: expected a parent in [0, {i}] "
                "(parents must precede children)"
            )

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """N, the root included."""
        return self.tokens.shape[1]

    @property
    def depth(self) -> int:
        """The deepest node's depth: at most this many draft tokens can be accepted in one round."""
        return int(self.depths.max())

    @functools.cached_property
    def tensors(self) -> TreeTensors:
        """The attention mask and the links, built in one kernel call the first time the target or the verifier
        asks, so a round builds its tree once."""
        return TreeTensors(*kernels.build_tree_tensors(self.parents))

    def positions(self, prefix_len: Tensor | int) -> Tensor:
        """[B, N] = prefix_len + depth; prefix_len counts the committed tokens before the root."""
        prefix_B = torch.as_tensor(prefix_len, dtype=torch.long, device=self.depths.device)
        return prefix_B.reshape(-1, 1) + self.depths

    def attention_mask(self) -> Tensor:
        """[B, N, N] bool, row i = ancestors of i plus i."""
        return self.tensors.mask_BNN

    def links(self) -> tuple[Tensor, Tensor]:
        """(next_token, next_sibling), each [B, N]: a node's first child and its next sibling, -1 for none."""
        return self.tensors.next_token_BN, self.tensors.next_sibling_BN


def _pick_children(
    logprobs_BKV: Tensor, count: int, generator: torch.Generator | None, sample: bool
) -> tuple[Tensor, Tensor]:
    """`count` children per frontier node: the top-`count` tokens, or `count` draws without replacement
    (Gumbel top-k, in draw order). Returns (tokens_BKC, logprobs_BKC)."""
    keys_BKV = logprobs_BKV.float()
    if sample:
        uniform = torch.rand(keys_BKV.shape, generator=generator, device=keys_BKV.device)
        tiny = torch.finfo(torch.float32).tiny
        gumbel_BKV = -torch.log((-torch.log(uniform.clamp(min=tiny))).clamp(min=tiny))
        keys_BKV = keys_BKV + gumbel_BKV
    tokens_BKC = keys_BKV.topk(count, dim=-1).indices
    return tokens_BKC, logprobs_BKV.float().gather(-1, tokens_BKC)


def _check_step_output(logprobs_BKV: Tensor, frontier_BK: Tensor, vocab: int, depth: int) -> None:
    expected = (*frontier_BK.shape, vocab)
    if tuple(logprobs_BKV.shape) != expected:
        raise ValueError(f"step_fn at depth {depth}: expected logprobs of shape {expected}, got {tuple(logprobs_BKV.shape)}")


def _check_root(root_tokens_B: Tensor, root_logprobs_BV: Tensor) -> None:
    if root_tokens_B.dim() != 1 or root_logprobs_BV.dim() != 2 or root_logprobs_BV.shape[0] != root_tokens_B.shape[0]:
        raise ValueError(
            f"root_tokens must be [B] and root_logprobs [B, V]; got {tuple(root_tokens_B.shape)} and "
            f"{tuple(root_logprobs_BV.shape)}"
        )


def static_tree(
    root_tokens_B: Tensor,
    root_logprobs_BV: Tensor,
    step_fn: StepFn,
    branching: list[int],
    keep_probs: bool = False,
    sample: bool = False,
    generator: torch.Generator | None = None,
) -> Tree:
    """A tree of fixed shape: every node at depth d - 1 gets branching[d - 1] children. Nodes are laid
    out depth by depth; step_fn is called len(branching) - 1 times, with the whole depth as frontier.

    sample=False takes each node's top-b tokens; sample=True draws b tokens without replacement from
    the draft distribution (use it with `verify_rejection(draft_probs=True)`, which then needs
    keep_probs=True)."""
    _check_root(root_tokens_B, root_logprobs_BV)
    if not branching or min(branching) < 1:
        raise ValueError(f"static_tree: branching must be a non-empty list of positive ints, got {branching}")
    B, V = root_logprobs_BV.shape
    device = root_tokens_B.device
    zeros_B1 = torch.zeros((B, 1), dtype=torch.long, device=device)
    tokens, parents, depths, scores = [root_tokens_B[:, None]], [zeros_B1 - 1], [zeros_B1], [zeros_B1.float()]
    probs = [root_logprobs_BV.float().softmax(-1)[:, None]] if keep_probs else []
    width = max(branching)
    ranked = [root_logprobs_BV.topk(width, dim=-1).indices[:, None]]

    logprobs_BKV = root_logprobs_BV[:, None, :]
    frontier_scores_BK = torch.zeros((B, 1), device=device)
    frontier_start = 0  # node index of the frontier's first node
    for depth, count in enumerate(branching, start=1):
        K = logprobs_BKV.shape[1]
        tokens_BKC, child_logprobs_BKC = _pick_children(logprobs_BKV, count, generator, sample)
        frontier_tokens_BF = tokens_BKC.flatten(1)
        frontier_scores_BK = (frontier_scores_BK[:, :, None] + child_logprobs_BKC).flatten(1)
        frontier_parent_BF = torch.arange(K, device=device).repeat_interleave(count).expand(B, -1)
        tokens.append(frontier_tokens_BF)
        parents.append(frontier_start + frontier_parent_BF)
        depths.append(torch.full_like(frontier_tokens_BF, depth))
        scores.append(frontier_scores_BK)
        frontier_start += K
        if depth == len(branching):
            break
        step_parent_BF = frontier_parent_BF if depth > 1 else torch.full_like(frontier_parent_BF, -1)
        logprobs_BKV = step_fn(frontier_tokens_BF, step_parent_BF, depth)
        _check_step_output(logprobs_BKV, frontier_tokens_BF, V, depth)
        ranked.append(logprobs_BKV.topk(width, dim=-1).indices)
        if keep_probs:
            probs.append(logprobs_BKV.float().softmax(-1))

    tree_tokens = torch.cat(tokens, 1)
    child_ranked = torch.full((*tree_tokens.shape, width), -1, dtype=torch.long, device=device)
    expanded_ranked = torch.cat(ranked, 1)
    child_ranked[:, : expanded_ranked.shape[1]] = expanded_ranked
    child_probs = None
    if keep_probs:
        child_probs = torch.zeros((*tree_tokens.shape, V), device=device)
        expanded = torch.cat(probs, 1)
        child_probs[:, : expanded.shape[1]] = expanded
    return Tree(tree_tokens, torch.cat(parents, 1), torch.cat(depths, 1), torch.cat(scores, 1), child_probs, sample,
                child_ranked)


def chain_tree(
    root_tokens_B: Tensor,
    root_logprobs_BV: Tensor,
    step_fn: StepFn,
    depth: int,
    keep_probs: bool = False,
    sample: bool = False,
    generator: torch.Generator | None = None,
) -> Tree:
    """A chain of `depth` draft tokens (static_tree with branching [1] * depth)."""
    return static_tree(root_tokens_B, root_logprobs_BV, step_fn, [1] * depth, keep_probs, sample, generator)


def grow_dynamic_tree(
    root_tokens_B: Tensor,
    root_logprobs_BV: Tensor,
    step_fn: StepFn,
    depth: int,
    topk: int,
    num_nodes: int,
    keep_probs: bool = False,
) -> Tree:
    """EAGLE-2 dynamic tree; N = num_nodes + 1.

    Depth-1 candidates are the root's top-K. At each later depth every one of the K frontier nodes
    proposes its top-K children, scored by cumulative log-probability (a sum of logs, never a product
    of probabilities); the best K of those K * K become the next frontier. step_fn is called depth - 1
    times. Finally the best num_nodes of all candidates are kept, ties going to the earlier-created
    node, so a kept node's parent (created earlier, score >= the child's) is always kept too.
    Candidates are top-k, not sampled: verify such trees greedily or with target-only rejection.
    """
    _check_root(root_tokens_B, root_logprobs_BV)
    total = topk + (depth - 1) * topk * topk
    if depth < 1 or topk < 1 or not 1 <= num_nodes <= total:
        raise ValueError(
            f"grow_dynamic_tree: need depth >= 1, topk >= 1 and 1 <= num_nodes <= topk + (depth-1) * topk^2 "
            f"= {total}; got depth={depth}, topk={topk}, num_nodes={num_nodes}"
        )
    B, V = root_logprobs_BV.shape
    device = root_tokens_B.device
    root_probs_BV = root_logprobs_BV.float().softmax(-1)

    tokens_B1K, scores_B1K = _pick_children(root_logprobs_BV[:, None, :], topk, None, sample=False)
    frontier_tokens_BK, frontier_scores_BK = tokens_B1K[:, 0], scores_B1K[:, 0]
    frontier_ids_BK = torch.arange(topk, device=device).expand(B, -1)  # candidate ids, in creation order
    frontier_parent_BK = torch.full((B, topk), -1, dtype=torch.long, device=device)
    cand_tokens, cand_scores = [frontier_tokens_BK], [frontier_scores_BK]
    cand_parent_ids = [torch.full_like(frontier_ids_BK, -1)]
    cand_depths = [torch.ones_like(frontier_tokens_BK)]
    expanded_ids, expanded_probs, expanded_ranked = [], [], []
    for frontier_depth in range(1, depth):
        logprobs_BKV = step_fn(frontier_tokens_BK, frontier_parent_BK, frontier_depth)
        _check_step_output(logprobs_BKV, frontier_tokens_BK, V, frontier_depth)
        expanded_ids.append(frontier_ids_BK)
        if keep_probs:
            expanded_probs.append(logprobs_BKV.float().softmax(-1))
        child_tokens_BKC, child_logprobs_BKC = _pick_children(logprobs_BKV, topk, None, sample=False)
        expanded_ranked.append(child_tokens_BKC)
        child_scores_BX = (frontier_scores_BK[:, :, None] + child_logprobs_BKC).flatten(1)  # X = K * K
        child_tokens_BX = child_tokens_BKC.flatten(1)
        first_id = topk + (frontier_depth - 1) * topk * topk
        child_ids_BX = (first_id + torch.arange(topk * topk, device=device)).expand(B, -1)
        cand_tokens.append(child_tokens_BX)
        cand_scores.append(child_scores_BX)
        cand_parent_ids.append(frontier_ids_BK.repeat_interleave(topk, dim=1))
        cand_depths.append(torch.full_like(child_tokens_BX, frontier_depth + 1))

        best_BK = child_scores_BX.sort(dim=1, descending=True, stable=True).indices[:, :topk]
        frontier_tokens_BK = child_tokens_BX.gather(1, best_BK)
        frontier_scores_BK = child_scores_BX.gather(1, best_BK)
        frontier_ids_BK = child_ids_BX.gather(1, best_BK)
        frontier_parent_BK = best_BK // topk

    all_scores_BX = torch.cat(cand_scores, 1)
    kept_BM = all_scores_BX.sort(dim=1, descending=True, stable=True).indices[:, :num_nodes].sort(dim=1).values
    node_of_BX = torch.full_like(all_scores_BX, -1, dtype=torch.long)  # candidate id -> node index
    node_of_BX.scatter_(1, kept_BM, torch.arange(1, num_nodes + 1, device=device).expand(B, -1))
    parent_ids_BM = torch.cat(cand_parent_ids, 1).gather(1, kept_BM)
    parent_nodes_BM = torch.where(parent_ids_BM >= 0, node_of_BX.gather(1, parent_ids_BM.clamp(min=0)), 0)

    zeros_B1 = torch.zeros((B, 1), dtype=torch.long, device=device)
    tokens = torch.cat([root_tokens_B[:, None], torch.cat(cand_tokens, 1).gather(1, kept_BM)], 1)
    parents = torch.cat([zeros_B1 - 1, parent_nodes_BM], 1)
    depths = torch.cat([zeros_B1, torch.cat(cand_depths, 1).gather(1, kept_BM)], 1)
    scores = torch.cat([zeros_B1.float(), all_scores_BX.gather(1, kept_BM)], 1)
    child_ranked, child_probs = _children_of_kept_nodes(
        node_of_BX, num_nodes, tokens_B1K[:, 0], root_probs_BV if keep_probs else None, expanded_ids,
        expanded_ranked, expanded_probs)
    log.debug("dynamic tree: %d rows, %d nodes, depth %d", B, num_nodes + 1, int(depths.max()))
    return Tree(tokens, parents, depths, scores, child_probs, child_ranked=child_ranked)


def _children_of_kept_nodes(node_of_BX: Tensor, num_nodes: int, root_ranked_BK: Tensor, root_probs_BV: Tensor | None,
                            expanded_ids: list[Tensor], expanded_ranked: list[Tensor],
                            expanded_probs: list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """Per kept node of a dynamic tree, the drafter's ranked children (and, with `root_probs_BV`, its whole
    distribution) where the node was expanded; -1 (zeros) where it was not."""
    B, topk = root_ranked_BK.shape
    device = root_ranked_BK.device
    child_ranked = torch.full((B, num_nodes + 1, topk), -1, dtype=torch.long, device=device)
    child_ranked[:, 0] = root_ranked_BK
    child_probs = None
    if root_probs_BV is not None:
        child_probs = torch.zeros((B, num_nodes + 1, root_probs_BV.shape[-1]), device=device)
        child_probs[:, 0] = root_probs_BV
    if expanded_ids:
        nodes_BE = node_of_BX.gather(1, torch.cat(expanded_ids, 1))  # E = expanded candidates
        kept_BE = nodes_BE >= 0
        rows_BE = torch.arange(B, device=device)[:, None].expand_as(nodes_BE)
        child_ranked[rows_BE[kept_BE], nodes_BE[kept_BE]] = torch.cat(expanded_ranked, 1)[kept_BE]
        if child_probs is not None:
            child_probs[rows_BE[kept_BE], nodes_BE[kept_BE]] = torch.cat(expanded_probs, 1)[kept_BE]
    return child_ranked, child_probs


def random_tree(
    batch_size: int, num_nodes: int, vocab_size: int, generator: torch.Generator | None = None, device="cpu"
) -> Tree:
    """Random trees (uniform random parent among earlier nodes, random tokens) for tests and benchmarks."""
    parents_BN = torch.full((batch_size, num_nodes), -1, dtype=torch.long)
    depths_BN = torch.zeros((batch_size, num_nodes), dtype=torch.long)
    for i in range(1, num_nodes):
        parents_BN[:, i] = torch.randint(0, i, (batch_size,), generator=generator)
        depths_BN[:, i] = depths_BN.gather(1, parents_BN[:, i : i + 1])[:, 0] + 1
    tokens_BN = torch.randint(0, vocab_size, (batch_size, num_nodes), generator=generator)
    scores_BN = torch.zeros((batch_size, num_nodes))
    return Tree(tokens_BN.to(device), parents_BN.to(device), depths_BN.to(device), scores_BN.to(device))
