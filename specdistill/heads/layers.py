"""Building blocks shared by the heads: norm, rotary embedding, MLP and one attention module.

Shapes: B batch, T tokens, D hidden, N heads, K kv heads, E head dim, S cached keys, Q queries.

Attention has one projection path and two cores: `ttt_attention` for training (step-0 keys causal,
plus each position's own keys from later steps) and `cached_attention` for drafting (a KV cache
with an explicit mask). Both see the same q/k/v, so training and inference cannot drift apart.
`ttt_attention` runs a fused CPU core (flash kernel + log-sum-exp merge) or the explicit one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb


@dataclass
class HeadArch:
    """Dimensions of a draft head's decoder block (Llama-style)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_parameters: dict  # the target's, as transformers >= 5 spells them; no default, so none is guessed
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """RoPE with the target's exact parameters (transformers' implementation, all rope types)."""

    def __init__(self, arch: HeadArch):
        super().__init__()
        self.inner = LlamaRotaryEmbedding(arch.llama_config())

    def forward(self, x: torch.Tensor, position_ids_BT: torch.Tensor):
        return self.inner(x, position_ids_BT)


CUDA_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the memory-efficient kernel's
BIAS_ALIGNMENT = 16  # the CUDA kernel reads the bias rows in aligned vectors


def ttt_attention(q_BNQE, keys, values, mask0_BQT=None) -> torch.Tensor:
    """Training-time-test attention for step j = len(keys) - 1.

    keys[0]/values[0] are the T step-0 entries, attended causally (q and keys[0] then have the same T) or
    under `mask0_BQT` (True = attend: packed documents, or Q queries at a subset of the positions);
    keys[i] for i >= 1 are the step-i entries of the queries' own positions, each attended only by its
    own query. On CPU, and on CUDA in 16/32-bit floats, the fused core (no [Q, T] matrix kept for
    backward) runs when values have the queries' head dim; elsewhere the explicit one.
    """
    fused_device = q_BNQE.device.type == "cpu" or (q_BNQE.device.type == "cuda" and q_BNQE.dtype in CUDA_FUSED_DTYPES)
    if fused_device and values[0].shape[-1] == q_BNQE.shape[-1]:  # the kernels need one head dim (MLA has two)
        bias_BNQT = None if mask0_BQT is None else attention_bias(mask0_BQT, q_BNQE)
        return FusedTTTAttention.apply(q_BNQE, bias_BNQT, *keys, *values)
    return ttt_attention_explicit(q_BNQE, keys, values, mask0_BQT)


def attention_bias(mask_BQT: torch.Tensor, q_BNQE: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, Q, T] (True = attend) -> additive bias (0 or -inf) in q's dtype, viewed [B, N, Q, T]
    (heads share one copy); its rows are padded to a multiple of BIAS_ALIGNMENT columns."""
    B, Q, T = mask_BQT.shape
    bias = torch.full((B, 1, Q, -(-T // BIAS_ALIGNMENT) * BIAS_ALIGNMENT), float("-inf"), dtype=q_BNQE.dtype,
                      device=mask_BQT.device)[..., :T]
    bias.masked_fill_(mask_BQT[:, None], 0.0)
    return bias.expand(q_BNQE.shape[0], q_BNQE.shape[1], Q, T)


def ttt_attention_explicit(q_BNQE, keys, values, mask0_BQT=None) -> torch.Tensor:
    """The TTT attention with the full [Q, T] step-0 score matrix plus the diagonal terms of later steps."""
    T = keys[0].shape[-2]
    if mask0_BQT is None:
        mask0_BQT = torch.ones(T, T, dtype=torch.bool, device=q_BNQE.device).tril()[None]
    scale = q_BNQE.shape[-1] ** -0.5
    s0_BNQT = torch.matmul(q_BNQE, keys[0].transpose(-1, -2)) * scale
    s0_BNQT = s0_BNQT.masked_fill(~mask0_BQT[:, None], torch.finfo(s0_BNQT.dtype).min)
    if len(keys) == 1:
        return torch.matmul(torch.softmax(s0_BNQT, -1, dtype=torch.float32).to(q_BNQE.dtype), values[0])
    diag_BNQJ = torch.stack([(q_BNQE * k).sum(-1) for k in keys[1:]], dim=-1) * scale
    probs = torch.softmax(torch.cat([s0_BNQT, diag_BNQJ], dim=-1), -1, dtype=torch.float32).to(q_BNQE.dtype)
    out = torch.matmul(probs[..., :T], values[0])
    v_BNQJE = torch.stack(values[1:], dim=3)
    return out + (probs[..., T:, None] * v_BNQJE).sum(dim=3)


def _fused_core(q, k, v, bias, scale):
    """Step-0 attention, its log-sum-exp [B, N, Q] (fp32) and the kernel's state for backward, from torch's
    fused kernel for the device: flash attention on CPU, the memory-efficient one on CUDA."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, bias is None, attn_mask=bias, scale=scale)
        return out, lse, ()
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, bias is None, scale=scale)
    return out, lse[..., : q.shape[-2]], (seed, offset, lse.shape[-1])  # CUDA pads lse's rows to blocks of 32


def _fused_core_backward(grad, q, k, v, bias, out, lse, state, scale):
    """dq, dk, dv of the step-0 share, given the merged output and log-sum-exp."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, bias is None, attn_mask=bias, scale=scale)
    seed, offset, padded = state
    lse = F.pad(lse, (0, padded - lse.shape[-1]))
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], bias is None, scale=scale)
    return dq, dk, dv


class FusedTTTAttention(torch.autograd.Function):
    """TTT attention from torch's fused attention kernel plus a log-sum-exp merge of the diagonal terms.

    Forward: the kernel gives the step-0 output and its log-sum-exp L0; the diagonal scores d_i join
    through L = logaddexp(L0, d_1..d_j), so out = exp(L0 - L) out0 + sum_i exp(d_i - L) v_i.
    Backward: the kernel's backward, handed the merged output and L, yields exactly the step-0 share of
    the gradients (its P = exp(s - L) and D = rowsum(dO * out) are those of the joint softmax); the
    diagonal terms' share is added by hand. Only q, k, v, out and L are kept: no [T, T] matrix.
    """

    @staticmethod
    def forward(ctx, q_BNTE, bias_BNTT, *keys_then_values):
        steps = len(keys_then_values) // 2
        keys, values = keys_then_values[:steps], keys_then_values[steps:]
        scale = q_BNTE.shape[-1] ** -0.5
        out_BNTE, lse_BNT, ctx.state = _fused_core(q_BNTE, keys[0], values[0], bias_BNTT, scale)
        if steps > 1:
            diag_BNTJ = torch.stack([(q_BNTE * k).sum(-1) for k in keys[1:]], dim=-1).float() * scale
            merged_BNT = torch.logaddexp(lse_BNT, diag_BNTJ.logsumexp(-1))
            p_BNTJ = torch.exp(diag_BNTJ - merged_BNT[..., None]).to(q_BNTE.dtype)
            out_BNTE = out_BNTE * torch.exp(lse_BNT - merged_BNT)[..., None].to(q_BNTE.dtype)
            for i, v in enumerate(values[1:]):
                out_BNTE = out_BNTE + p_BNTJ[..., i, None] * v
            lse_BNT = merged_BNT
        ctx.scale, ctx.steps = scale, steps
        ctx.save_for_backward(q_BNTE, bias_BNTT, out_BNTE, lse_BNT, *keys_then_values)
        return out_BNTE

    @staticmethod
    def backward(ctx, grad_BNTE):
        q_BNTE, bias_BNTT, out_BNTE, lse_BNT, *keys_then_values = ctx.saved_tensors
        keys, values = keys_then_values[: ctx.steps], keys_then_values[ctx.steps:]
        grad_BNTE = grad_BNTE.contiguous()
        dq, dk0, dv0 = _fused_core_backward(grad_BNTE, q_BNTE, keys[0], values[0], bias_BNTT, out_BNTE, lse_BNT,
                                            ctx.state, ctx.scale)
        dkeys, dvalues = [dk0], [dv0]
        rowdot_BNT = (grad_BNTE * out_BNTE).sum(-1).float()
        for k, v in zip(keys[1:], values[1:]):
            p_BNT = torch.exp((q_BNTE * k).sum(-1).float() * ctx.scale - lse_BNT)
            ds_BNT = (p_BNT * ((grad_BNTE * v).sum(-1).float() - rowdot_BNT) * ctx.scale).to(q_BNTE.dtype)
            dq = dq + ds_BNT[..., None] * k
            dkeys.append(ds_BNT[..., None] * q_BNTE)
            dvalues.append(p_BNT.to(q_BNTE.dtype)[..., None] * grad_BNTE)
        return (dq, None, *dkeys, *dvalues)


def cached_attention(q_BNQE, k_BNSE, v_BNSE, mask_BQS) -> torch.Tensor:
    """Drafting attention over a KV cache (committed prefix + tree nodes) with an explicit mask."""
    return F.scaled_dot_product_attention(q_BNQE, k_BNSE, v_BNSE, attn_mask=mask_BQS[:, None])


class Attention(nn.Module):
    """Llama attention whose q/k/v read an input of `in_dim` (2H for EAGLE-3's cat(emb, hidden))."""

    def __init__(self, arch: HeadArch, in_dim: int):
        super().__init__()
        self.arch = arch
        n, k, e = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.q_proj = nn.Linear(in_dim, n * e, bias=False)
        self.k_proj = nn.Linear(in_dim, k * e, bias=False)
        self.v_proj = nn.Linear(in_dim, k * e, bias=False)
        self.o_proj = nn.Linear(n * e, arch.hidden_size, bias=False)

    def project(self, x_BTI, cos_sin):
        """q [B, N, T, E] and k, v [B, K, T, E], with RoPE applied to q and k."""
        B, T, _ = x_BTI.shape
        e = self.arch.head_dim
        q = self.q_proj(x_BTI).view(B, T, -1, e).transpose(1, 2)
        k = self.k_proj(x_BTI).view(B, T, -1, e).transpose(1, 2)
        v = self.v_proj(x_BTI).view(B, T, -1, e).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        return q, k, v

    def expand_kv(self, x_BKTE: torch.Tensor) -> torch.Tensor:
        rep = self.arch.num_attention_heads // self.arch.num_key_value_heads
        return x_BKTE.repeat_interleave(rep, dim=1) if rep > 1 else x_BKTE

    def output(self, o_BNTE: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = o_BNTE.shape
        return self.o_proj(o_BNTE.transpose(1, 2).reshape(B, T, -1))
