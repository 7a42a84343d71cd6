"""DeepSeek-V3-style MTP head: eh_proj over cat(enorm(embedding of the next token), hnorm(previous
hidden)), one Llama decoder block, a final norm and a head; fed by the target's last hidden state.

One module applied recursively (`num_modules=1`) or k separate modules (step j uses module j).
Parameter names follow the MTP export layout: `mtp.{k}.{enorm,hnorm,eh_proj,layers.0.*,norm}`,
shared `embed_tokens` (frozen target copy) and `lm_head` (over the draft vocabulary).

Shapes: B batch, T tokens, D hidden, H target hidden, V draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdistill.heads.base import DraftHead, DraftHeadConfig
from specdistill.heads.layers import MLP, Attention, HeadArch, RMSNorm, Rotary


@dataclass
class MTPConfig(DraftHeadConfig):  # of the captured layers the MTP head reads only `last`
    num_modules: int = 1
    kind: str = "mtp"


class DecoderBlock(nn.Module):
    """A plain pre-norm Llama block (q/k/v read D)."""

    def __init__(self, arch: HeadArch):
        super().__init__()
        D = arch.hidden_size
        self.input_layernorm = RMSNorm(D, arch.rms_norm_eps)
        self.self_attn = Attention(arch, in_dim=D)
        self.post_attention_layernorm = RMSNorm(D, arch.rms_norm_eps)
        self.mlp = MLP(D, arch.intermediate_size)

    def forward(self, x_BTD, cos_sin, attend) -> torch.Tensor:
        q, k, v = self.self_attn.project(self.input_layernorm(x_BTD), cos_sin)
        h = x_BTD + self.self_attn.output(attend(q, k, v))
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPModule(nn.Module):
    def __init__(self, arch: HeadArch, target_hidden: int):
        super().__init__()
        D = arch.hidden_size
        self.enorm = RMSNorm(D, arch.rms_norm_eps)
        self.hnorm = RMSNorm(target_hidden, arch.rms_norm_eps)
        self.eh_proj = nn.Linear(D + target_hidden, D, bias=False)
        self.layers = nn.ModuleList([DecoderBlock(arch)])
        self.norm = RMSNorm(D, arch.rms_norm_eps)


class MTPHead(DraftHead):
    def __init__(self, config: MTPConfig):
        super().__init__(config.vocab_size, config.draft_vocab_size, config.arch.hidden_size)
        self.config = config
        arch = config.arch
        self.mtp = nn.ModuleList(
            [MTPModule(arch, config.target_hidden_size) for _ in range(config.num_modules)]
        )
        self.rotary = Rotary(arch)

    def module(self, depth: int) -> MTPModule:
        return self.mtp[min(depth, len(self.mtp) - 1)]

    def initial_hidden(self, aux_BTA: torch.Tensor, last_BTH: torch.Tensor | None = None) -> torch.Tensor:
        """Step-0 hidden input: the target's last hidden state (before its final norm)."""
        if last_BTH is None:
            raise ValueError(
                "the MTP head reads the target's last hidden state; the batch has none "
                "(capture.teacher=topk stores no `last`: use capture.teacher=last)"
            )
        return last_BTH.to(self.lm_head.weight.dtype)

    def step(self, token_ids_BT, hidden_BTD, position_ids_BT, attend, depth: int = 0) -> torch.Tensor:
        m = self.module(depth)
        emb = self.embed_tokens(token_ids_BT).to(hidden_BTD.dtype)
        x = m.eh_proj(torch.cat([m.enorm(emb), m.hnorm(hidden_BTD)], dim=-1))
        return m.layers[0](x, self.rotary(x, position_ids_BT), attend)

    def logits(self, hidden_BTD: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.lm_head(self.module(depth).norm(hidden_BTD))

    def attention(self) -> Attention:
        return self.mtp[0].layers[0].self_attn

    def module_state_dicts(self) -> list[dict[str, torch.Tensor]]:
        """One dict per module under the export layout's keys (shared tensors repeated per module)."""
        shared = {"embed_tokens.weight": self.embed_tokens.weight, "lm_head.weight": self.lm_head.weight}
        return [{**shared, **{k: v for k, v in m.state_dict().items()}} for m in self.mtp]
