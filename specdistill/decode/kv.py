"""KV-cache compaction after verification: the accepted path's keys and values move to contiguous
positions right after the prefix, and the rest of the tree's entries are dropped.

Layout: the target's cache holds the committed prefix at [0, tree_start) and the tree forward wrote
node i at tree_start + i. After `compact_kv`, row b holds the root and its accepted nodes at
tree_start + 0 .. tree_start + accept_len[b]. With a batch, rows accept different numbers of tokens:
crop every row to tree_start + max(accept_len) + 1 (what `compact_cache` does) and mask, in the next
forward's attention mask, the entries of row b from tree_start + accept_len[b] + 1 up to that crop
(they are stale tree entries), or pad rows to a common length on the left before the next round.

Shape legend: B batch rows, H heads, L cache length, D head dim, S = tree depth + 1 verdict slots.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from specdistill.decode import kernels
from specdistill.decode.kernels import reference

log = logging.getLogger(__name__)


def compact_kv(keys_BHLD: Tensor, values_BHLD: Tensor, tree_start: int, accept_nodes_BS: Tensor) -> None:
    """In place: for each row, the entries at tree_start + accept_nodes[b, s] move to tree_start + s
    (slots with -1 are left alone). accept_nodes is a verdict's: it starts with the root 0 and
    increases along the path."""
    if keys_BHLD.dim() != 4 or values_BHLD.dim() != 4 or keys_BHLD.shape[:3] != values_BHLD.shape[:3]:
        raise ValueError(
            f"compact_kv: keys and values must be [B, H, L, D] with the same B, H, L; got {tuple(keys_BHLD.shape)} "
            f"and {tuple(values_BHLD.shape)}"
        )
    B, _, L, _ = keys_BHLD.shape
    if accept_nodes_BS.dim() != 2 or accept_nodes_BS.shape[0] != B:
        raise ValueError(f"compact_kv: accept_nodes must be [{B}, S], got {tuple(accept_nodes_BS.shape)}")
    last = tree_start + int(accept_nodes_BS.max())
    if tree_start < 0 or max(last, tree_start + accept_nodes_BS.shape[1] - 1) >= L:
        raise ValueError(
            f"compact_kv: tree_start={tree_start} with accepted node up to {int(accept_nodes_BS.max())} and "
            f"{accept_nodes_BS.shape[1]} slots does not fit a cache of length {L}"
        )
    if keys_BHLD.shape == values_BHLD.shape:
        kernels.compact_kv(keys_BHLD, values_BHLD, tree_start, accept_nodes_BS)
    else:  # MLA caches keys and values of different widths; the kernels move one shape
        reference.compact_kv(keys_BHLD, values_BHLD, tree_start, accept_nodes_BS)


class ReplayCache:
    """The committed tokens of one row, replayed through the target at every verification, for a target whose
    linear-attention layers (Qwen3-Next's gated DeltaNet) keep a recurrent state that no rejected draft can be
    taken out of. Exact for one row drafting a chain, whose tokens the recurrence reads in order; each round
    costs a forward over the whole sequence, so it serves checks on small targets (the engine comparison)."""

    def __init__(self):
        self.ids_BL = self.pending_BN = None  # one unpadded row: its positions are 0 .. L-1

    def replay(self, input_ids_BN: Tensor, mask: Tensor | None, position_ids_BN: Tensor) -> tuple[Tensor, ...]:
        """(ids, mask, positions) of the whole sequence to run: the committed tokens, then `input_ids` (a chain; the
        prefill when nothing is committed yet)."""
        if input_ids_BN.shape[0] != 1:
            raise ValueError(f"ReplayCache replays one row, got a batch of {input_ids_BN.shape[0]}")
        if self.ids_BL is None:
            self.ids_BL = input_ids_BN
            return input_ids_BN, mask, position_ids_BN
        N, L = input_ids_BN.shape[1], self.ids_BL.shape[1]
        chain_NN = torch.ones(N, N, dtype=torch.bool, device=input_ids_BN.device).tril()
        if mask is None or not torch.equal(mask[0, 0, :, L:].bool(), chain_NN):
            raise ValueError("ReplayCache verifies a chain of drafts (draft shape `chain`), not a tree: a recurrent "
                             "state reads tokens in one order")
        self.pending_BN = input_ids_BN
        causal_LL = torch.ones(L, L + N, dtype=torch.bool, device=mask.device).tril()
        full_mask = torch.cat([causal_LL[None, None], mask.bool()], dim=2)
        committed_BL = torch.arange(L, device=position_ids_BN.device)[None]
        return torch.cat([self.ids_BL, input_ids_BN], 1), full_mask, torch.cat([committed_BL, position_ids_BN], 1)

    def commit(self, accept_len_B: Tensor) -> None:
        """Commit the accepted path of the last chain: its root and accepted drafts, in order."""
        self.ids_BL = torch.cat([self.ids_BL, self.pending_BN[:, : int(accept_len_B.max()) + 1]], 1)


def compact_cache(cache, tree_start: int, accept_nodes_BS: Tensor, accept_len_B: Tensor) -> int:
    """Compact every layer of a transformers DynamicCache and crop it to tree_start + max(accept_len) + 1 (a
    ReplayCache commits the accepted path instead). Returns the new cache length (the next round's prefix length
    for the longest row)."""
    new_length = tree_start + int(accept_len_B.max()) + 1
    if isinstance(cache, ReplayCache):
        cache.commit(accept_len_B)
        return new_length
    for layer in cache.layers:
        compact_kv(layer.keys, layer.values, tree_start, accept_nodes_BS)
    extra = cache.get_seq_length() - new_length
    if extra > 0:
        cache.crop(-extra)
    log.debug("compacted the KV cache to %d entries", new_length)
    return new_length
