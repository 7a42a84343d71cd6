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

from torch import Tensor

from specdistill.spec import kernels
from specdistill.spec.kernels import reference

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


def compact_cache(cache, tree_start: int, accept_nodes_BS: Tensor, accept_len_B: Tensor) -> int:
    """Compact every layer of a transformers DynamicCache and crop it to tree_start + max(accept_len) + 1.
    Returns the new cache length (the next round's prefix length for the longest row)."""
    new_length = tree_start + int(accept_len_B.max()) + 1
    for layer in cache.layers:
        compact_kv(layer.keys, layer.values, tree_start, accept_nodes_BS)
    extra = cache.get_seq_length() - new_length
    if extra > 0:
        cache.crop(-extra)
    log.debug("compacted the KV cache to %d entries", new_length)
    return new_length
