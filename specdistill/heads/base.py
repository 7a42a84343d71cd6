"""What every draft head shares: the frozen target embedding, the draft-vocab lm_head, d2t / t2d."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from specdistill.heads.layers import HeadArch


@dataclass(kw_only=True)
class TargetFields:
    """What every head's config holds of its target, and its (de)serialisation. Keyword-only, so each head's own
    fields follow whichever of these have defaults."""

    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # decoder-layer outputs (1, L//2-1, L-4): what the feature store holds
    target_num_layers: int
    target_name: str | None = None  # the target it was trained for (None: read back from an engine export)
    target_embedding: str | None = None  # `embedding_fingerprint` of that target's input embedding

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        return cls(**d)


@dataclass(kw_only=True)
class DraftHeadConfig(TargetFields):
    """A head of our own layers: its target's fields and its layers' sizes (a nested HeadArch)."""

    arch: HeadArch

    @classmethod
    def from_dict(cls, d: dict):
        return super().from_dict(d | {"arch": HeadArch(**d["arch"])})


def drafts_in_parallel(head) -> bool:
    """A P-EAGLE or DFlash head: its depths past the first read a mask, not the draft before them, so one forward
    drafts a chain and a tree would branch into copies of one distribution."""
    return head.config.kind == "dflash" or bool(getattr(head.config, "parallel_drafting", False))


class DraftHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, hidden_size: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head = nn.Linear(hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))

    def step_input(self, token_ids_BT: torch.Tensor, hidden_BTD: torch.Tensor, depth: int):
        """What a slot at `depth` >= 1 reads, given the previous draft and the previous output: those, unless the
        head drafts its depths in parallel (P-EAGLE)."""
        return token_ids_BT, hidden_BTD

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def init_from_target(
        self,
        embed_weight: torch.Tensor | None,
        lm_head_weight: torch.Tensor | None,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
    ) -> None:
        """Copy the frozen target embedding (and optionally its lm_head rows of the draft vocab)."""
        if embed_weight is None:
            self.embed_tokens.weight.requires_grad_(True)  # another width than the target: learn it
        else:
            self.embed_tokens.weight.copy_(embed_weight)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if lm_head_weight is not None:
            self.lm_head.weight.copy_(lm_head_weight[torch.arange(len(d2t)) + d2t])

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the rotary cache (the frozen embedding is kept: engines may read it)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
