"""EAGLE-3 draft head: fc over the target's captured layers, one decoder layer over
cat(input_layernorm(embedding), hidden_norm(hidden)), final norm, lm_head over the draft vocabulary.

Parameter names are the SGLang checkpoint layout (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`),
so exporters only rename where an engine wants something else.

Shapes: B batch, T tokens, D head hidden, A = num_aux * target hidden, V draft vocab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from specdistill.heads.layers import MLP, Attention, HeadArch, RMSNorm, Rotary


@dataclass
class Eagle3Config:
    arch: HeadArch
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]  # decoder-layer outputs (1, L//2-1, L-4)
    target_num_layers: int
    kind: str = "eagle3"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        d = dict(d)
        d["arch"] = HeadArch(**d["arch"])
        return cls(**d)


class Eagle3Layer(nn.Module):
    """The midlayer: attention reads 2D (embedding + hidden); the residual is the hidden path only."""

    def __init__(self, arch: HeadArch):
        super().__init__()
        D = arch.hidden_size
        self.input_layernorm = RMSNorm(D, arch.rms_norm_eps)
        self.hidden_norm = RMSNorm(D, arch.rms_norm_eps)
        self.self_attn = Attention(arch, in_dim=2 * D)
        self.post_attention_layernorm = RMSNorm(D, arch.rms_norm_eps)
        self.mlp = MLP(D, arch.intermediate_size)

    def forward(self, emb_BTD, hidden_BTD, cos_sin, attend) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb_BTD), self.hidden_norm(hidden_BTD)], dim=-1)
        q, k, v = self.self_attn.project(x, cos_sin)
        h = hidden_BTD + self.self_attn.output(attend(q, k, v))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The head the trainer, the drafter and the exporters share (interface: initial_hidden, step, logits)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        arch = config.arch
        num_aux = len(config.aux_layer_ids)
        self.embed_tokens = nn.Embedding(config.vocab_size, arch.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(num_aux * config.target_hidden_size, arch.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(arch)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary = Rotary(arch)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    def initial_hidden(self, aux_BTA: torch.Tensor, last_BTH: torch.Tensor | None = None) -> torch.Tensor:
        """Step-0 hidden input: the fused target features."""
        return self.fc(aux_BTA.to(self.fc.weight.dtype))

    def step(self, token_ids_BT, hidden_BTD, position_ids_BT, attend) -> torch.Tensor:
        """One application of the layer; `attend(q, k, v) -> o` is the attention core (TTT or cached)."""
        emb = self.embed_tokens(token_ids_BT).to(hidden_BTD.dtype)
        cos_sin = self.rotary(hidden_BTD, position_ids_BT)
        return self.midlayer(emb, hidden_BTD, cos_sin, attend)

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [B, T, V]."""
        return self.lm_head(self.norm(hidden_BTD))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def attention(self) -> Attention:
        return self.midlayer.self_attn

    @torch.no_grad()
    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None,
                         d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Copy the frozen target embedding (and optionally its lm_head rows of the draft vocab)."""
        self.embed_tokens.weight.copy_(embed_weight)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if lm_head_weight is not None:
            draft_ids = torch.arange(len(d2t)) + d2t
            self.lm_head.weight.copy_(lm_head_weight[draft_ids])

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the rotary cache (the frozen embedding is kept: engines may read it)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
