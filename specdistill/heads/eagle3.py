"""EAGLE-3 draft head: fc over the target's captured layers, one decoder layer over
cat(input_layernorm(embedding), hidden_norm(hidden)), final norm, lm_head over the draft vocabulary.
Eagle 3.1's `fc_norm` puts one RMSNorm on each captured layer before `fc`. P-EAGLE (`parallel_drafting`) drafts
every depth in one forward: past depth 0 a slot reads the mask token and `fc(mask_hidden)` instead of the previous
draft and the previous output, so the depths differ only in position and in what they attend to.

Parameter names are the SGLang checkpoint layout (`fc`, `fc_norm.<i>`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`), so exporters only rename where an engine wants something else.

Shapes: B batch, T tokens, D head hidden, A = num_aux * target hidden, V draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdistill.heads.base import DraftHead, DraftHeadConfig
from specdistill.heads.layers import MLP, Attention, HeadArch, RMSNorm, Rotary


@dataclass
class Eagle3Config(DraftHeadConfig):
    kind: str = "eagle3"
    fc_norm: bool = False  # Eagle 3.1: an RMSNorm per captured layer before fc (a config without it: plain EAGLE-3)
    parallel_drafting: bool = False  # P-EAGLE: depths past 0 read `mask_token_id` and `mask_hidden`
    mask_token_id: int | None = None


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


class Eagle3Head(DraftHead):
    """The head the trainer, the drafter and the exporters share (interface: initial_hidden, step, logits)."""

    def __init__(self, config: Eagle3Config):
        super().__init__(config.vocab_size, config.draft_vocab_size, config.arch.hidden_size)
        self.config = config
        arch = config.arch
        num_aux = len(config.aux_layer_ids)
        # as vLLM builds them: one per captured layer, that layer's width, the draft's rms_norm_eps (the target's)
        self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, arch.rms_norm_eps)
                                     for _ in range(num_aux)) if config.fc_norm else None
        self.fc = nn.Linear(num_aux * config.target_hidden_size, arch.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(arch)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch)
        if config.parallel_drafting:
            if config.mask_token_id is None or not 0 <= config.mask_token_id < config.vocab_size:
                raise ValueError(f"P-EAGLE head: mask_token_id {config.mask_token_id!r} is not a token id below the "
                                 f"vocabulary size {config.vocab_size}")
            # standard normal, as speculators starts it; served through fc (and fc_norm) like the target's layers
            self.mask_hidden = nn.Parameter(torch.randn(1, num_aux * config.target_hidden_size))

    def initial_hidden(self, aux_BTA: torch.Tensor, last_BTH: torch.Tensor | None = None) -> torch.Tensor:
        """Step-0 hidden input: the fused target features."""
        return self.fc(self.fc_input(aux_BTA.to(self.fc.weight.dtype)))

    def fc_input(self, aux_BTA: torch.Tensor) -> torch.Tensor:
        """What `fc` reads: the captured layers as concatenated, each through its own norm under `fc_norm` (in
        capture order, as the engines chunk them)."""
        if self.fc_norm is None:
            return aux_BTA
        layers = aux_BTA.chunk(len(self.fc_norm), dim=-1)
        return torch.cat([norm(layer) for norm, layer in zip(self.fc_norm, layers)], dim=-1)

    def step_input(self, token_ids_BT, hidden_BTD, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a slot at `depth` >= 1 reads: the previous draft and the previous output (EAGLE-3), or the mask
        token and `fc(mask_hidden)` (P-EAGLE), shaped like them."""
        if not self.config.parallel_drafting:
            return token_ids_BT, hidden_BTD
        mask_hidden = self.initial_hidden(self.mask_hidden).to(hidden_BTD.dtype)
        return torch.full_like(token_ids_BT, self.config.mask_token_id), mask_hidden.expand(*token_ids_BT.shape, -1)

    def step(self, token_ids_BT, hidden_BTD, position_ids_BT, attend, depth: int = 0) -> torch.Tensor:
        """One application of the layer; `attend(q, k, v) -> o` is the attention core (TTT or cached).

        EAGLE-3 reuses its one layer at every depth, so `depth` is unused here."""
        emb = self.embed_tokens(token_ids_BT).to(hidden_BTD.dtype)
        cos_sin = self.rotary(hidden_BTD, position_ids_BT)
        return self.midlayer(emb, hidden_BTD, cos_sin, attend)

    def logits(self, hidden_BTD: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Logits over the draft vocabulary [B, T, V]."""
        return self.lm_head(self.norm(hidden_BTD))

    def attention(self) -> Attention:
        return self.midlayer.self_attn
