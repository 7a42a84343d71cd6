"""The Training-Time Test: unroll the head k steps on its own outputs, as it will run when drafting.

Step j at position t reads the token x[t+1+j] and the head's step j-1 output at t (step 0 reads the
fused target features), sits at RoPE position t+j, attends causally to step-0 keys and to its own
position's keys from steps 1..j, and is trained toward the target's distribution at t+1+j for the
token x[t+2+j], weighted step_weight**j.

Shapes: B batch, T tokens, A aux features, D head hidden, V draft vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdistill.heads.layers import ttt_attention
from specdistill.train.teacher import TeacherTargets


@dataclass
class TTTBatch:
    input_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor  # 1 where the token is one the head should learn to predict
    valid_BT: torch.Tensor  # bool, False on padding
    aux_BTA: torch.Tensor
    last_BTH: torch.Tensor | None = None


@dataclass
class TTTResult:
    loss: torch.Tensor  # weighted sum over steps, differentiable
    step_loss: torch.Tensor  # [k] mean loss per step (detached)
    step_acc: torch.Tensor  # [k] draft argmax == target argmax, over loss-masked positions
    step_accept: torch.Tensor  # [k] expected acceptance sum_v min(p, q)
    step_count: torch.Tensor  # [k] positions counted

    def simulated_tau(self) -> float:
        """Chain tau implied by per-step accuracy: 1 + sum_j prod_{i<=j} acc_i."""
        return float(1 + torch.cumprod(self.step_acc, 0).sum())


def shift_left(x_BT: torch.Tensor, s: int, fill=0) -> torch.Tensor:
    """x[:, t + s], padded with `fill` past the end."""
    if s == 0:
        return x_BT
    pad = torch.full_like(x_BT[:, :s], fill)
    return torch.cat([x_BT[:, s:], pad], dim=1)


def causal_mask(valid_BT: torch.Tensor) -> torch.Tensor:
    T = valid_BT.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=valid_BT.device).tril()
    return causal[None] & valid_BT[:, None, :]


def unroll_ttt(head, batch: TTTBatch, teacher: TeacherTargets, steps: int, step_weight: float,
               loss_fn: Callable) -> TTTResult:
    ids, valid = batch.input_ids_BT, batch.valid_BT
    B, T = ids.shape
    positions = torch.arange(T, device=ids.device).expand(B, T)
    mask0 = causal_mask(valid)
    attn = head.attention()
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def attend(q, k, v):
        keys.append(attn.expand_kv(k))
        values.append(attn.expand_kv(v))
        return ttt_attention(q, keys, values, mask0)

    # 1. step-0 hidden input: the fused target features
    hidden = head.initial_hidden(batch.aux_BTA, batch.last_BTH)
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(4, steps, dtype=torch.float64)
    for j in range(steps):
        # 2. step j reads token x[t+1+j] and the previous step's hidden, at position t+j
        hidden = head.step(shift_left(ids, 1 + j), hidden, positions + j, attend, depth=j)
        logits = head.logits(hidden, depth=j)
        # 3. its target is the teacher at t+1+j predicting x[t+2+j]; mask loss, padding and coverage
        target_logp = shift_left(teacher.logp_BTV, 1 + j)
        counted = (shift_left(batch.loss_mask_BT, 2 + j) > 0) & shift_left(valid, 2 + j, False) & valid
        trained = counted & shift_left(teacher.covered_BT, 1 + j, False)
        per_pos = loss_fn(logits, target_logp)
        n = trained.sum().clamp(min=1)
        step_loss = (per_pos * trained).sum() / n
        total = total + step_weight**j * step_loss
        # 4. metrics on every counted position (coverage misses count as misses)
        with torch.no_grad():
            q = torch.softmax(logits.float(), -1)
            draft_argmax = head.draft_to_target(logits.argmax(-1))
            hit = (draft_argmax == shift_left(teacher.argmax_BT, 1 + j)) & counted
            accept = torch.minimum(q, shift_left(teacher.p_full_BTV, 1 + j)).sum(-1) * counted
            c = counted.sum()
            stats[:, j] = torch.stack([step_loss.detach().double() * c, hit.sum().double(),
                                       accept.sum().double(), c.double()]).cpu()
    count = stats[3].clamp(min=1)
    return TTTResult(total, stats[0] / count, stats[1] / count, stats[2] / count, stats[3])
