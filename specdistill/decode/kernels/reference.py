"""Torch references of the tree kernels: the definition of what each Triton kernel must compute.

Each function here has a twin with the same signature in `triton_kernels.py`; the tests compare the two.
These run on any device and are what CPU users get. Randomness never happens inside a kernel: the
caller passes the uniform draws, so both backends consume the same numbers and give the same answer.

Shape legend: B batch rows, N tree nodes, V vocabulary, S verdict slots (tree depth + 1),
H heads, L cache length, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

NONE = -1  # "no such node" in every index tensor


def build_tree_tensors(parents_BN: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What the target's tree attention and a verifier read from parent lists (nothing else: every output
    is read, so a timing of this kernel counts no dead work).

    Returns (mask_BNN bool: ancestors plus self, next_token_BN = lowest-indexed child,
    next_sibling_BN = next higher-indexed node with the same parent), -1 where there is none. Parents
    must precede children (parents[b, i] < i, root's parent -1).
    """
    B, N = parents_BN.shape
    device = parents_BN.device
    idx_N = torch.arange(N, device=device)

    mask_BNN = torch.eye(N, dtype=torch.bool, device=device).expand(B, N, N).clone()
    ancestor_BN = parents_BN.clone()
    while bool((ancestor_BN >= 0).any()):  # one hop up per pass; ends because parents precede children
        has_BN = ancestor_BN >= 0
        mask_BNN |= has_BN[:, :, None] & (ancestor_BN[:, :, None] == idx_N)
        ancestor_BN = torch.where(has_BN, parents_BN.gather(1, ancestor_BN.clamp(min=0)), ancestor_BN)

    is_child_BNN = parents_BN[:, None, :] == idx_N[None, :, None]  # [b, i, j]: j is a child of i
    next_token_BN = torch.where(is_child_BNN, idx_N, N).amin(-1)
    later_sibling_BNN = (
        (parents_BN[:, :, None] == parents_BN[:, None, :])
        & (idx_N[None, None, :] > idx_N[None, :, None])
        & (parents_BN[:, :, None] >= 0)
    )
    next_sibling_BN = torch.where(later_sibling_BNN, idx_N, N).amin(-1)
    next_token_BN = torch.where(next_token_BN == N, NONE, next_token_BN)
    next_sibling_BN = torch.where(next_sibling_BN == N, NONE, next_sibling_BN)
    return mask_BNN, next_token_BN, next_sibling_BN


def empty_verdict(B: int, num_slots: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """(accept_nodes_BS with only the root, accept_len_B = 0, out_tokens_BS all -1): what kernels fill in."""
    accept_nodes_BS = torch.full((B, num_slots), NONE, dtype=torch.long, device=device)
    accept_nodes_BS[:, 0] = 0
    out_tokens_BS = torch.full((B, num_slots), NONE, dtype=torch.long, device=device)
    return accept_nodes_BS, torch.zeros(B, dtype=torch.long, device=device), out_tokens_BS


def greedy_verify(
    tokens_BN: Tensor, next_token_BN: Tensor, next_sibling_BN: Tensor, target_argmax_BN: Tensor, num_slots: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Walk from the root: among the current node's children (in sibling order) accept the first whose
    token is the target's argmax at the current node; stop when none is. The bonus token is the argmax
    at the last accepted node. Returns (accept_nodes_BS, accept_len_B, out_tokens_BS), padded with -1."""
    B = tokens_BN.shape[0]
    rows_B = torch.arange(B, device=tokens_BN.device)
    accept_nodes_BS, accept_len_B, out_tokens_BS = empty_verdict(B, num_slots, tokens_BN.device)
    current_B = torch.zeros(B, dtype=torch.long, device=tokens_BN.device)
    candidate_B = next_token_BN[:, 0].clone()
    active_B = candidate_B >= 0
    while bool(active_B.any()):
        cand_B = candidate_B.clamp(min=0)
        hit_B = active_B & (tokens_BN[rows_B, cand_B] == target_argmax_BN[rows_B, current_B])
        accept_len_B += hit_B.long()
        accept_nodes_BS[rows_B[hit_B], accept_len_B[hit_B]] = candidate_B[hit_B]
        current_B = torch.where(hit_B, candidate_B, current_B)
        candidate_B = torch.where(hit_B, next_token_BN[rows_B, cand_B], next_sibling_BN[rows_B, cand_B])
        active_B &= (candidate_B >= 0) & (accept_len_B < num_slots - 1)

    _fill_tokens(tokens_BN, accept_nodes_BS, accept_len_B, out_tokens_BS, target_argmax_BN[rows_B, current_B])
    return accept_nodes_BS, accept_len_B, out_tokens_BS


def _fill_tokens(tokens_BN, accept_nodes_BS, accept_len_B, out_tokens_BS, bonus_B) -> None:
    """Committed tokens: the accepted nodes' tokens (slots 1..len moved to 0..len-1), then the bonus."""
    drafted_BS = accept_nodes_BS[:, 1:]
    out_tokens_BS[:, :-1] = torch.where(drafted_BS >= 0, tokens_BN.gather(1, drafted_BS.clamp(min=0)), NONE)
    out_tokens_BS.scatter_(1, accept_len_B[:, None], bonus_B[:, None])


def _normalized(probs_BV: Tensor, fallback_BV: Tensor) -> Tensor:
    """Rows divided by their sum; a row with nothing left keeps `fallback` (a measure-zero event)."""
    total_B1 = probs_BV.sum(-1, keepdim=True)
    return torch.where(total_B1 > 0, probs_BV / total_B1.clamp(min=torch.finfo(probs_BV.dtype).tiny), fallback_BV)


def rejection_sample(
    tokens_BN: Tensor,
    next_token_BN: Tensor,
    next_sibling_BN: Tensor,
    target_probs_BNV: Tensor,
    draft_probs_BNV: Tensor | None,
    coins_BN: Tensor,
    final_u_B: Tensor,
    num_slots: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recursive rejection sampling down the tree.

    At the current node the residual target is p (the target's processed distribution there). Children
    are tried in sibling order; child j with token x is accepted when coins[j] * q(x) < p(x), i.e. with
    probability min(1, p(x) / q(x)). On rejection p <- norm(max(p - q, 0)) and, for candidates drawn
    without replacement, q <- norm(q with x removed). `draft_probs_BNV=None` means target-only: q is
    one-hot at x, so acceptance is p(x) and the residual is p with x removed. After the walk the bonus
    token is drawn from the residual p by inverse CDF with `final_u_B`. Returns (accept_nodes_BS,
    accept_len_B, out_tokens_BS) like `greedy_verify`.
    """
    B, N, V = target_probs_BNV.shape
    device = tokens_BN.device
    rows_B = torch.arange(B, device=device)
    accept_nodes_BS, accept_len_B, out_tokens_BS = empty_verdict(B, num_slots, device)
    p_BV = target_probs_BNV[:, 0].float().clone()
    q_BV = draft_probs_BNV[:, 0].float().clone() if draft_probs_BNV is not None else None
    candidate_B = next_token_BN[:, 0].clone()
    active_B = candidate_B >= 0
    while bool(active_B.any()):
        cand_B = candidate_B.clamp(min=0)
        x_B = tokens_BN[rows_B, cand_B]
        px_B = p_BV[rows_B, x_B]
        qx_B = q_BV[rows_B, x_B] if q_BV is not None else torch.ones_like(px_B)
        hit_B = active_B & (coins_BN[rows_B, cand_B] * qx_B < px_B)
        miss_B = active_B & ~hit_B

        x_is_BV = torch.nn.functional.one_hot(x_B, V).bool()
        if q_BV is not None:
            residual_BV = _normalized((p_BV - q_BV).clamp(min=0), p_BV)
            q_next_BV = _normalized(q_BV.masked_fill(x_is_BV, 0.0), q_BV)
        else:
            residual_BV = _normalized(p_BV.masked_fill(x_is_BV, 0.0), p_BV)
        child_B = torch.where(hit_B, candidate_B, 0)
        p_BV = torch.where(miss_B[:, None], residual_BV, p_BV)
        p_BV = torch.where(hit_B[:, None], target_probs_BNV[rows_B, child_B].float(), p_BV)
        if q_BV is not None:
            q_BV = torch.where(miss_B[:, None], q_next_BV, q_BV)
            q_BV = torch.where(hit_B[:, None], draft_probs_BNV[rows_B, child_B].float(), q_BV)

        accept_len_B += hit_B.long()
        accept_nodes_BS[rows_B[hit_B], accept_len_B[hit_B]] = candidate_B[hit_B]
        candidate_B = torch.where(hit_B, next_token_BN[rows_B, cand_B], next_sibling_BN[rows_B, cand_B])
        active_B &= (candidate_B >= 0) & (accept_len_B < num_slots - 1)

    cdf_BV = p_BV.cumsum(-1)
    threshold_B = final_u_B.float() * p_BV.sum(-1)
    bonus_B = (cdf_BV <= threshold_B[:, None]).sum(-1).clamp(max=V - 1)
    _fill_tokens(tokens_BN, accept_nodes_BS, accept_len_B, out_tokens_BS, bonus_B)
    return accept_nodes_BS, accept_len_B, out_tokens_BS


def compact_kv(keys_BHLD: Tensor, values_BHLD: Tensor, tree_start: int, accept_nodes_BS: Tensor) -> None:
    """In place: cache entry tree_start + accept_nodes[b, s] moves to tree_start + s for every valid slot.
    All sources are read before anything is written, so overlapping moves are safe."""
    S = accept_nodes_BS.shape[1]
    valid_B1S1 = (accept_nodes_BS >= 0)[:, None, :, None]
    source_B1S1 = (tree_start + accept_nodes_BS.clamp(min=0))[:, None, :, None]
    for cache_BHLD in (keys_BHLD, values_BHLD):  # keys and values may differ in width (MLA)
        B, H, _, D = cache_BHLD.shape
        moved_BHSD = cache_BHLD.gather(2, source_B1S1.expand(B, H, S, D))
        window_BHSD = cache_BHLD[:, :, tree_start : tree_start + S]
        window_BHSD.copy_(torch.where(valid_B1S1, moved_BHSD, window_BHSD))
