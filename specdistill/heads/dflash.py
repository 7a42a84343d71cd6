"""DFlash draft head: block denoising conditioned on the target's captured layers.

One forward drafts a whole block. Its queries are the last committed token (the bonus the target just chose) and
`block_size - 1` copies of a mask token, at the positions right after the committed prefix; slot k's output is the
draft for the token k places past the bonus. Every layer's queries attend, without a causal mask, to the whole
block and to keys and values projected from the context: `hidden_norm(fc(captured layers))` of each committed
position, the same context for every layer (no layer runs over it), each layer with its own `k_proj`/`v_proj`.
The layers are Qwen3 decoder layers (RMSNorm on each head's q and k before RoPE), as vLLM's `DFlashQwen3Model`
builds them; the embedding (so the mask token's) is the target's, frozen.

Shapes: B batch, T context positions, Q block slots, D head hidden, A = num_aux * target hidden, N heads, K kv
heads, E head dim, V draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdistill.heads.base import DraftHead, DraftHeadConfig
from specdistill.heads.layers import MLP, Attention, HeadArch, RMSNorm, Rotary


@dataclass
class DFlashConfig(DraftHeadConfig):
    mask_token_id: int
    block_size: int  # the bonus slot plus the mask slots trained (train.ttt_steps + 1)
    num_layers: int = 1
    kind: str = "dflash"


class QKNormAttention(Attention):
    """Qwen3 attention: an RMSNorm over each head's q and k before RoPE. Projects the block's q, k, v and, apart, the
    context's k, v (vLLM precomputes those once per committed position)."""

    def __init__(self, arch: HeadArch):
        super().__init__(arch, arch.hidden_size)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)

    def heads(self, proj: nn.Linear, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        return proj(x_BTD).view(B, T, proj.out_features // self.arch.head_dim, self.arch.head_dim).transpose(1, 2)

    def project(self, x_BTD, cos_sin):
        q = self.q_norm(self.heads(self.q_proj, x_BTD))
        k = self.k_norm(self.heads(self.k_proj, x_BTD))
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        return q, k, self.heads(self.v_proj, x_BTD)

    def project_context(self, ctx_BTD, cos_sin):
        k = self.k_norm(self.heads(self.k_proj, ctx_BTD))
        return apply_rotary_pos_emb(k, k, *cos_sin)[0], self.heads(self.v_proj, ctx_BTD)


def dense_attention(mask_BQS: torch.Tensor):
    """Attention under any mask (True = attend) over the context's T keys then the block's Q (the drafter's: the
    committed prefix and the whole block)."""
    def attend(q, context_k, context_v, k, v):
        return F.scaled_dot_product_attention(q, torch.cat([context_k, k], 2), torch.cat([context_v, v], 2),
                                              attn_mask=mask_BQS[:, None])
    return attend


def blockwise_attention(sees_BQT: torch.Tensor, width: int):
    """Queries in blocks of `width` that attend to their own block's keys, all of them, and to the context keys
    `sees_BQT` allows (training's many blocks side by side): the [Q, Q] product of `dense_attention`, almost all of
    it masked, becomes one [width, width] product per block."""
    def attend(q, context_k, context_v, k, v):
        B, N, Q, E = q.shape
        T, R = context_k.shape[2], Q // width
        scores = (q @ context_k.transpose(-1, -2)).masked_fill(~sees_BQT[:, None], float("-inf"))
        q_blocks, k_blocks, v_blocks = (x.view(B, N, R, width, E) for x in (q, k, v))
        own = (q_blocks @ k_blocks.transpose(-1, -2)).view(B, N, Q, width)
        p = torch.softmax(torch.cat([scores, own], -1).float() * E**-0.5, -1).to(q.dtype)
        return p[..., :T] @ context_v + (p[..., T:].view(B, N, R, width, width) @ v_blocks).view(B, N, Q, E)
    return attend


class DFlashLayer(nn.Module):
    def __init__(self, arch: HeadArch):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = QKNormAttention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)

    def forward(self, x_BQD, cos_sin, context_kv, attend) -> torch.Tensor:
        """`context_kv`: this layer's context (k, v) [B, K, T, E]; `attend(q, context k, context v, block k, block v)`
        the attention core (`dense_attention`, `blockwise_attention`), every head's keys given."""
        attn, expand = self.self_attn, self.self_attn.expand_kv
        q, k, v = attn.project(self.input_layernorm(x_BQD), cos_sin)
        o = attend(q, expand(context_kv[0]), expand(context_kv[1]), expand(k), expand(v))
        x = x_BQD + attn.output(o)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftHead):
    def __init__(self, config: DFlashConfig):
        super().__init__(config.vocab_size, config.draft_vocab_size, config.arch.hidden_size)
        if not 0 <= config.mask_token_id < config.vocab_size:
            raise ValueError(f"DFlash head: mask_token_id {config.mask_token_id!r} is not a token id below the "
                             f"vocabulary size {config.vocab_size}")
        if config.block_size < 2:
            raise ValueError(f"DFlash head: block_size {config.block_size} leaves no mask slot to draft")
        self.config = config
        arch = config.arch
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(arch) for _ in range(config.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary = Rotary(arch)

    def context_kv(self, aux_BTA: torch.Tensor, positions_BT: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k, v) [B, K, T, E] of the committed positions, from their captured layers."""
        ctx = self.hidden_norm(self.fc(aux_BTA.to(self.fc.weight.dtype)))
        cos_sin = self.rotary(ctx, positions_BT)
        return [layer.self_attn.project_context(ctx, cos_sin) for layer in self.layers]

    def block_input(self, bonus_B: torch.Tensor, slots: int | None = None) -> torch.Tensor:
        """[B, Q] token ids of a block: the bonus, then mask tokens."""
        slots = slots or self.config.block_size
        tokens = torch.full((len(bonus_B), slots), self.config.mask_token_id, dtype=torch.long, device=bonus_B.device)
        tokens[:, 0] = bonus_B
        return tokens

    def block(self, tokens_BQ, positions_BQ, context_kv, attend) -> torch.Tensor:
        """The block's final hidden states [B, Q, D]."""
        x = self.embed_tokens(tokens_BQ).to(self.fc.weight.dtype)
        cos_sin = self.rotary(x, positions_BQ)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos_sin, kv, attend)
        return x

    def logits(self, hidden_BQD: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_BQD))
