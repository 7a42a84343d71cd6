"""Triton kernels for the tree: build (mask, links), greedy verification,
rejection sampling and KV compaction. Same signatures and results as `reference.py`.

One program per tree row (or per (row, node) / (row, head)); a tree is at most a few hundred nodes,
so each program holds a whole row of nodes in registers and walks the tree with scalar loads, as a
serving engine's verifier does. Runs on CUDA tensors, or on CPU under TRITON_INTERPRET=1.

Shape legend: B batch rows, N tree nodes, V vocabulary, S verdict slots, H heads, L cache length,
D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from specdistill.decode.kernels.reference import empty_verdict

VOCAB_BLOCK = 1024  # vocabulary columns per step of the rejection sampler's row passes
# Inside kernels "no such node" is the literal -1 (reference.NONE): Triton reads only constexpr globals.


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _build_tree_kernel(parents_ptr, mask_ptr, next_token_ptr, next_sibling_ptr, N, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    i = tl.program_id(1)
    row = b * N
    offs = tl.arange(0, BLOCK_N)
    in_tree = offs < N
    parents = tl.load(parents_ptr + row + offs, mask=in_tree, other=-2)

    ancestors = offs == i
    cur = tl.load(parents_ptr + row + i)
    while cur >= 0:
        ancestors = ancestors | (offs == cur)
        cur = tl.load(parents_ptr + row + cur)
    tl.store(mask_ptr + (row + i) * N + offs, ancestors, mask=in_tree)

    first_child = tl.min(tl.where(parents == i, offs, N), axis=0)
    tl.store(next_token_ptr + row + i, tl.where(first_child == N, -1, first_child).to(tl.int64))
    my_parent = tl.load(parents_ptr + row + i)
    later_sibling = (parents == my_parent) & (offs > i) & (my_parent >= 0)
    sibling = tl.min(tl.where(later_sibling, offs, N), axis=0)
    tl.store(next_sibling_ptr + row + i, tl.where(sibling == N, -1, sibling).to(tl.int64))


def build_tree_tensors(parents_BN: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B, N = parents_BN.shape
    device = parents_BN.device
    mask_BNN = torch.empty((B, N, N), dtype=torch.bool, device=device)
    next_token_BN, next_sibling_BN = (torch.empty((B, N), dtype=torch.long, device=device) for _ in range(2))
    _build_tree_kernel[(B, N)](parents_BN.contiguous(), mask_BNN, next_token_BN, next_sibling_BN, N,
                               BLOCK_N=_block(N))
    return mask_BNN, next_token_BN, next_sibling_BN


@triton.jit
def _greedy_verify_kernel(
    tokens_ptr, next_token_ptr, next_sibling_ptr, argmax_ptr, accept_ptr, length_ptr, out_ptr, N, S,
):
    b = tl.program_id(0)
    row = b * N
    slots = b * S
    length = tl.zeros((), tl.int64)
    want = tl.load(argmax_ptr + row)
    candidate = tl.load(next_token_ptr + row)
    while (candidate >= 0) & (length < S - 1):
        token = tl.load(tokens_ptr + row + candidate)
        if token == want:
            length += 1
            tl.store(accept_ptr + slots + length, candidate)
            tl.store(out_ptr + slots + length - 1, token)
            want = tl.load(argmax_ptr + row + candidate)
            candidate = tl.load(next_token_ptr + row + candidate)
        else:
            candidate = tl.load(next_sibling_ptr + row + candidate)
    tl.store(out_ptr + slots + length, want)
    tl.store(length_ptr + b, length)


def greedy_verify(
    tokens_BN: Tensor, next_token_BN: Tensor, next_sibling_BN: Tensor, target_argmax_BN: Tensor, num_slots: int
) -> tuple[Tensor, Tensor, Tensor]:
    B, N = tokens_BN.shape
    accept_nodes_BS, accept_len_B, out_tokens_BS = empty_verdict(B, num_slots, tokens_BN.device)
    _greedy_verify_kernel[(B,)](
        tokens_BN.contiguous(), next_token_BN.contiguous(), next_sibling_BN.contiguous(),
        target_argmax_BN.contiguous(), accept_nodes_BS, accept_len_B, out_tokens_BS, N, num_slots,
    )
    return accept_nodes_BS, accept_len_B, out_tokens_BS


@triton.jit
def _load_distribution(src_ptr, dst_ptr, V, BLOCK_V: tl.constexpr):
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < V, other=0.0).to(tl.float32), mask=offs < V)


# N and S stay runtime values: specialised to 1 (a root-only tree), the loop folds away and Triton 3.6's
# coalescing pass fails on what is left.
@triton.jit(do_not_specialize=["N", "S"])
def _rejection_kernel(
    tokens_ptr, next_token_ptr, next_sibling_ptr, target_ptr, draft_ptr, coins_ptr, final_u_ptr,
    p_ptr, q_ptr, accept_ptr, length_ptr, out_ptr, N, V, S, HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    row = b * N
    slots = b * S
    p_row = p_ptr + b * V  # the residual target at the current node
    q_row = q_ptr + b * V  # the draft distribution the remaining children are drawn from
    _load_distribution(target_ptr + row * V, p_row, V, BLOCK_V)
    if HAS_DRAFT:
        _load_distribution(draft_ptr + row * V, q_row, V, BLOCK_V)
    tl.debug_barrier()
    length = tl.zeros((), tl.int64)
    candidate = tl.load(next_token_ptr + row)
    while (candidate >= 0) & (length < S - 1):
        token = tl.load(tokens_ptr + row + candidate)
        px = tl.load(p_row + token)
        qx = 1.0
        if HAS_DRAFT:
            qx = tl.load(q_row + token)
        if tl.load(coins_ptr + row + candidate) * qx < px:
            length += 1
            tl.store(accept_ptr + slots + length, candidate)
            tl.store(out_ptr + slots + length - 1, token)
            tl.debug_barrier()
            _load_distribution(target_ptr + (row + candidate) * V, p_row, V, BLOCK_V)
            if HAS_DRAFT:
                _load_distribution(draft_ptr + (row + candidate) * V, q_row, V, BLOCK_V)
            tl.debug_barrier()
            candidate = tl.load(next_token_ptr + row + candidate)
        else:
            p_total = 0.0
            q_total = 0.0
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                p = tl.load(p_row + offs, mask=offs < V, other=0.0)
                if HAS_DRAFT:
                    q = tl.load(q_row + offs, mask=offs < V, other=0.0)
                    p_total += tl.sum(tl.maximum(p - q, 0.0), axis=0)
                    q_total += tl.sum(tl.where(offs == token, 0.0, q), axis=0)
                else:
                    p_total += tl.sum(tl.where(offs == token, 0.0, p), axis=0)
            tl.debug_barrier()
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                p = tl.load(p_row + offs, mask=offs < V, other=0.0)
                if HAS_DRAFT:
                    q = tl.load(q_row + offs, mask=offs < V, other=0.0)
                    residual = tl.maximum(p - q, 0.0)
                    q_rest = tl.where(offs == token, 0.0, q)
                    if q_total > 0:
                        tl.store(q_row + offs, q_rest / q_total, mask=offs < V)
                else:
                    residual = tl.where(offs == token, 0.0, p)
                if p_total > 0:
                    tl.store(p_row + offs, residual / p_total, mask=offs < V)
            tl.debug_barrier()
            candidate = tl.load(next_sibling_ptr + row + candidate)

    p_total = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p_total += tl.sum(tl.load(p_row + offs, mask=offs < V, other=0.0), axis=0)
    threshold = tl.load(final_u_ptr + b) * p_total
    below = tl.zeros((), tl.int64)  # tokens whose cumulative probability is <= threshold
    running = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(p_row + offs, mask=offs < V, other=0.0)
        cdf = running + tl.cumsum(p, axis=0)
        below += tl.sum(((cdf <= threshold) & (offs < V)).to(tl.int64), axis=0)
        running += tl.sum(p, axis=0)
    tl.store(out_ptr + slots + length, tl.minimum(below, V - 1))
    tl.store(length_ptr + b, length)


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
    B, N, V = target_probs_BNV.shape
    device = tokens_BN.device
    accept_nodes_BS, accept_len_B, out_tokens_BS = empty_verdict(B, num_slots, device)
    p_BV = torch.empty((B, V), dtype=torch.float32, device=device)
    q_BV = torch.empty((B, V), dtype=torch.float32, device=device) if draft_probs_BNV is not None else p_BV
    target_probs_BNV = target_probs_BNV.contiguous()
    draft = draft_probs_BNV.contiguous() if draft_probs_BNV is not None else target_probs_BNV
    _rejection_kernel[(B,)](
        tokens_BN.contiguous(), next_token_BN.contiguous(), next_sibling_BN.contiguous(), target_probs_BNV,
        draft, coins_BN.float().contiguous(), final_u_B.float().contiguous(), p_BV, q_BV,
        accept_nodes_BS, accept_len_B, out_tokens_BS, N, V, num_slots,
        HAS_DRAFT=draft_probs_BNV is not None, BLOCK_V=min(VOCAB_BLOCK, _block(V)),
    )
    return accept_nodes_BS, accept_len_B, out_tokens_BS


@triton.jit
def _compact_kv_kernel(
    keys_ptr, values_ptr, accept_ptr, tree_start, S, stride_b, stride_h, stride_l, D, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = b * stride_b + h * stride_h
    offs = tl.arange(0, BLOCK_D)
    in_dim = offs < D
    # Slots in increasing order: slot s reads node >= s and writes s, so no source is overwritten first.
    for slot in range(0, S):
        node = tl.load(accept_ptr + b * S + slot)
        if (node >= 0) & (node != slot):
            src = base + (tree_start + node) * stride_l + offs
            dst = base + (tree_start + slot) * stride_l + offs
            tl.store(keys_ptr + dst, tl.load(keys_ptr + src, mask=in_dim), mask=in_dim)
            tl.store(values_ptr + dst, tl.load(values_ptr + src, mask=in_dim), mask=in_dim)
        tl.debug_barrier()


def compact_kv(keys_BHLD: Tensor, values_BHLD: Tensor, tree_start: int, accept_nodes_BS: Tensor) -> None:
    if keys_BHLD.stride() != values_BHLD.stride() or keys_BHLD.stride(-1) != 1:
        raise ValueError(
            f"compact_kv (triton): keys and values need equal strides with a contiguous last dim, got "
            f"{keys_BHLD.stride()} and {values_BHLD.stride()}"
        )
    B, H, _, D = keys_BHLD.shape
    stride_b, stride_h, stride_l, _ = keys_BHLD.stride()
    _compact_kv_kernel[(B, H)](
        keys_BHLD, values_BHLD, accept_nodes_BS.contiguous(), tree_start, accept_nodes_BS.shape[1],
        stride_b, stride_h, stride_l, D, BLOCK_D=_block(D),
    )
