"""Verification of a draft tree against the target's logits at every node: which path is accepted and
which tokens are committed this round. Batched; each row accepts its own number of tokens.

- `verify_greedy`: temperature 0. Walk from the root to the child whose token is the target's argmax
  at the parent; the bonus token is the argmax at the last accepted node. Output equals plain
  greedy decoding.
- `verify_rejection`: sampling, lossless (the committed tokens are distributed exactly as sampling
  from the target with the same temperature / top-k / top-p):
    draft_probs=False: target-only. The draft is treated as one-hot at each candidate; valid for any
      tree, including the top-k trees of `grow_dynamic_tree`.
    draft_probs=True: multi-candidate with the draft's q and recursive residuals; more accepted
      tokens when q is close to p, but exact only when the candidates were DRAWN from q: use a tree
      from `static_tree(..., sample=True, keep_probs=True)` (or `chain_tree`). A top-k tree is
      refused, because deterministic candidates are not draws from q.

Shape legend: B batch rows, N tree nodes, V vocabulary, S = tree depth + 1 verdict slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdistill.decode import kernels
from specdistill.decode.tree import Tree


@dataclass
class Verdict:
    accept_nodes: Tensor  # [B, S] node indices of the accepted path starting with the root 0, padded with -1
    accept_len: Tensor  # [B] accepted draft tokens (root and bonus not counted)
    tokens: Tensor  # [B, S] accepted draft tokens then the bonus token, padded with -1 (accept_len + 1 valid)


def _check_logits(tree: Tree, target_logits_BNV: Tensor) -> None:
    if target_logits_BNV.dim() != 3 or tuple(target_logits_BNV.shape[:2]) != (tree.batch_size, tree.num_nodes):
        raise ValueError(
            f"target_logits: expected shape ({tree.batch_size}, {tree.num_nodes}, V) (one row per tree node), "
            f"got {tuple(target_logits_BNV.shape)}"
        )


def verify_greedy(tree: Tree, target_logits_BNV: Tensor) -> Verdict:
    """Greedy verification (temperature 0)."""
    _check_logits(tree, target_logits_BNV)
    next_token_BN, next_sibling_BN = tree.links()
    argmax_BN = target_logits_BNV.argmax(-1)
    return Verdict(*kernels.greedy_verify(tree.tokens, next_token_BN, next_sibling_BN, argmax_BN, tree.depth + 1))


def sampling_probs(logits_BNV: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The distribution a sampler draws from: softmax(logits / temperature), restricted to the top_k
    tokens (0: all; ties with the k-th kept), then to the smallest set whose mass reaches top_p
    (always at least the most likely token), renormalized. float32."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature} (use verify_greedy for 0)")
    if not 0.0 < top_p <= 1.0 or top_k < 0:
        raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got top_k={top_k}, top_p={top_p}")
    scaled_BNV = logits_BNV.float() / temperature
    if 0 < top_k < scaled_BNV.shape[-1]:
        kth_BN1 = scaled_BNV.topk(top_k, dim=-1).values[..., -1:]
        scaled_BNV = scaled_BNV.masked_fill(scaled_BNV < kth_BN1, float("-inf"))
    probs_BNV = scaled_BNV.softmax(-1)
    if top_p < 1.0:
        sorted_BNV, order_BNV = probs_BNV.sort(-1, descending=True)
        mass_before_BNV = sorted_BNV.cumsum(-1) - sorted_BNV
        drop_sorted_BNV = mass_before_BNV >= top_p
        drop_BNV = torch.zeros_like(drop_sorted_BNV).scatter(-1, order_BNV, drop_sorted_BNV)
        probs_BNV = probs_BNV.masked_fill(drop_BNV, 0.0)
        probs_BNV = probs_BNV / probs_BNV.sum(-1, keepdim=True)
    return probs_BNV


def verify_rejection(
    tree: Tree,
    target_logits_BNV: Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    draft_probs: bool = True,
) -> Verdict:
    """Lossless rejection sampling down the tree (see the module docstring for which mode fits which
    tree). temperature 0 falls back to greedy verification."""
    _check_logits(tree, target_logits_BNV)
    if temperature == 0:
        return verify_greedy(tree, target_logits_BNV)
    q_BNV = None
    if draft_probs:
        if tree.child_probs is None or not tree.sampled:
            raise ValueError(
                "verify_rejection(draft_probs=True) needs a tree whose children were sampled from the draft and "
                "which kept them: grow it with static_tree/chain_tree(..., sample=True, keep_probs=True), or "
                "verify with draft_probs=False (target-only, exact for any tree)"
            )
        if tree.child_probs.shape[-1] != target_logits_BNV.shape[-1]:
            raise ValueError(
                f"tree.child_probs has vocabulary {tree.child_probs.shape[-1]} but target_logits has "
                f"{target_logits_BNV.shape[-1]}: both must be over the target vocabulary"
            )
        q_BNV = tree.child_probs
    p_BNV = sampling_probs(target_logits_BNV, temperature, top_k, top_p)
    next_token_BN, next_sibling_BN = tree.links()
    device = tree.tokens.device
    coins_BN = torch.rand(tree.tokens.shape, generator=generator, device=device)
    final_u_B = torch.rand(tree.batch_size, generator=generator, device=device)
    return Verdict(
        *kernels.rejection_sample(
            tree.tokens, next_token_BN, next_sibling_BN, p_BNV, q_BNV, coins_BN, final_u_B, tree.depth + 1
        )
    )


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy (verified greedily, lossless token for token)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def pick(self, logits_BV: Tensor, generator: torch.Generator | None) -> Tensor:
        if self.temperature == 0:
            return logits_BV.argmax(-1)
        probs_BV = sampling_probs(logits_BV[:, None], self.temperature, self.top_k, self.top_p)[:, 0]
        return torch.multinomial(probs_BV, 1, generator=generator)[:, 0]

    def verify(self, tree: Tree, logits_BNV: Tensor, generator: torch.Generator | None) -> Verdict:
        """Greedy at temperature 0; otherwise rejection sampling, multi-candidate when the tree was sampled."""
        if self.temperature == 0:
            return verify_greedy(tree, logits_BNV)
        return verify_rejection(tree, logits_BNV, self.temperature, self.top_k, self.top_p, generator,
                                draft_probs=tree.sampled)


GREEDY = Sampling()
