"""The draft vocabulary: the N target tokens the head predicts, chosen by loss-masked frequency.

The head's lm_head has exactly N rows, so N is always the configured size, even when the data holds
fewer distinct tokens: the remaining slots are filled with the lowest unseen ids. A BPE tokenizer
numbers its merges in the order it learned them, most frequent first, so these are the pieces most
common in its corpus: words a prompt may hold that the training answers never used, which the head can
then copy. Their rows train on the target's soft probabilities like every other row.

Legend: N = draft vocab size, V = target vocab size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdistill.io import save_tensors


@dataclass
class DraftVocab:
    d2t_N: torch.Tensor  # int64, target_id = i + d2t_N[i] (the offset layout engines load)
    t2d_V: torch.Tensor  # bool, True where a target token is in the draft vocab
    counts_V: torch.Tensor  # int64, loss-masked occurrences of each target token

    @property
    def size(self) -> int:
        return int(self.d2t_N.numel())

    @property
    def target_ids_N(self) -> torch.Tensor:
        """Draft index -> target token id, ascending."""
        return torch.arange(self.size, dtype=torch.int64) + self.d2t_N

    @property
    def coverage(self) -> float:
        """Share of loss-masked tokens whose target id is inside the draft vocab."""
        total = int(self.counts_V.sum())
        return float(self.counts_V[self.t2d_V].sum()) / total if total else 0.0

    def save(self, path: str | Path) -> None:
        save_tensors(path, {"d2t": self.d2t_N, "t2d": self.t2d_V, "counts": self.counts_V},
                     metadata={"draft_vocab_size": str(self.size), "target_vocab_size": str(self.t2d_V.numel())})

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        tensors = load_file(str(path))
        missing = {"d2t", "t2d", "counts"} - tensors.keys()
        if missing:
            raise ValueError(f"{path}: missing tensors {sorted(missing)}; expected d2t, t2d, counts")
        return cls(d2t_N=tensors["d2t"], t2d_V=tensors["t2d"], counts_V=tensors["counts"])


def count_tokens(sequences, masks, vocab_size: int) -> torch.Tensor:
    """Loss-masked token counts over `vocab_size` ids (int64 [V])."""
    counts_V = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in zip(sequences, masks):
        ids_T = torch.as_tensor(ids, dtype=torch.int64)
        kept = ids_T[torch.as_tensor(mask, dtype=torch.bool)]
        counts_V += torch.bincount(kept, minlength=vocab_size)[:vocab_size]
    return counts_V


def build_draft_vocab(counts_V: torch.Tensor, size: int) -> DraftVocab:
    """Top-`size` ids by count (ties: lower id first), sorted by id; unseen ids pad when too few."""
    vocab_size = counts_V.numel()
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocab size {size} must be in [1, target vocab size {vocab_size}]")
    # A stable sort on descending counts keeps ascending ids among equal counts, unseen ids included.
    order = torch.sort(counts_V.to(torch.int64), descending=True, stable=True).indices
    chosen_N = torch.sort(order[:size]).values
    t2d_V = torch.zeros(vocab_size, dtype=torch.bool)
    t2d_V[chosen_N] = True
    d2t_N = chosen_N - torch.arange(size, dtype=torch.int64)
    return DraftVocab(d2t_N=d2t_N, t2d_V=t2d_V, counts_V=counts_V.to(torch.int64).clone())
