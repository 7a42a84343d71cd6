"""The Training-Time Test: unroll the head k steps on its own outputs, as it will run when drafting.

Step j at position t reads the token x[t+1+j] and the head's step j-1 output at t (step 0 reads the
fused target features), sits at RoPE position t+j, attends causally to step-0 keys and to its own
position's keys from steps 1..j, and is trained toward the target's distribution at t+1+j for the
token x[t+2+j], weighted step_weight**j. In a packed row (several documents) attention stays inside
each document, positions restart per document, and a position is trained only if x[t+2+j] belongs to
its own document, so no shift crosses a document boundary. Steps >= 1 run only at the positions some
later step trains: a position's later steps read step-0 keys and their own, nothing else.

Shapes: B batch, T tokens, M positions run at a step (all T at step 0), A aux features, D head hidden,
V draft vocab.
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
    doc_BT: torch.Tensor | None = None  # packed rows: document number per token, -1 on padding
    position_ids_BT: torch.Tensor | None = None  # packed rows: positions restarting at each document


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


def padded_documents(valid_BT: torch.Tensor) -> torch.Tensor:
    """Document numbers of a right-padded batch: one document per row (0), padding -1."""
    return torch.where(valid_BT, 0, -1)


def document_mask(doc_BT: torch.Tensor) -> torch.Tensor:
    """Step-0 mask [B, T, T] (True = attend): causal inside each document; padding sees only padding."""
    T = doc_BT.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_BT.device).tril()
    return causal[None] & (doc_BT[:, :, None] == doc_BT[:, None, :])


def causal_mask(valid_BT: torch.Tensor) -> torch.Tensor:
    """The explicit step-0 mask of a right-padded batch (what `mask0=None` means on its valid rows)."""
    return document_mask(padded_documents(valid_BT))


def gather_rows(x: torch.Tensor, idx_BM: torch.Tensor) -> torch.Tensor:
    """x[b, idx[b, m]] for x of shape [B, T] or [B, T, X]."""
    index = idx_BM if x.dim() == 2 else idx_BM[..., None].expand(-1, -1, x.shape[-1])
    return x.gather(1, index)


def later_step_positions(counted_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx_BM, valid_BM): per row, the positions marked in `counted_BT`, left-aligned and padded with
    position 0 (valid False); M >= 1 so that an empty selection still has a shape."""
    count_B = counted_BT.sum(1)
    M = max(1, int(count_B.max()) if counted_BT.numel() else 0)
    order_BT = torch.sort((~counted_BT).to(torch.int8), dim=1, stable=True).indices  # marked positions first
    idx_BM = order_BT[:, :M]
    valid_BM = torch.arange(M, device=counted_BT.device)[None] < count_B[:, None]
    return torch.where(valid_BM, idx_BM, 0), valid_BM


def unroll_ttt(head, batch: TTTBatch, teacher: TeacherTargets, steps: int, step_weight: float,
               loss_fn: Callable) -> TTTResult:
    ids = batch.input_ids_BT
    B, T = ids.shape
    dev = ids.device
    packed = batch.doc_BT is not None
    doc_BT = batch.doc_BT if packed else padded_documents(batch.valid_BT)
    positions_BT = batch.position_ids_BT if packed else torch.arange(T, device=dev).expand(B, T)
    mask0_BTT = document_mask(doc_BT) if packed else None  # None: plain causal (right padding needs no mask)
    attn = head.attention()
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    mask_BQT = mask0_BTT

    def attend(q, k, v):
        keys.append(attn.expand_kv(k))
        values.append(attn.expand_kv(v))
        return ttt_attention(q, keys, values, mask_BQT)

    def at(x_BT: torch.Tensor, shift: int, fill=0) -> torch.Tensor:
        """x[b, idx[b, m] + shift], `fill` past the end."""
        src = idx_BM + shift
        inside = src < T
        picked = gather_rows(x_BT, src.clamp(max=T - 1))
        return torch.where(inside, picked, torch.as_tensor(fill, dtype=x_BT.dtype, device=dev))

    def counted_at(j: int) -> torch.Tensor:
        """Positions trained at step j: x[t+2+j] is a loss token of t's own document."""
        return (at(batch.loss_mask_BT, 2 + j) > 0) & (at(doc_BT, 2 + j, -2) == at(doc_BT, 0)) & (at(doc_BT, 0) >= 0)

    # 1. step 0 runs at every position (every later step attends to its keys); steps >= 1 only where some
    #    later step is trained (the assistant turns), since a position's later steps see only step-0 keys
    #    and its own: on chat data most positions of a long prompt need step 0 alone.
    idx_BM = torch.arange(T, device=dev).expand(B, T)
    row_valid_BM = torch.ones(B, T, dtype=torch.bool, device=dev)
    hidden = head.initial_hidden(batch.aux_BTA, batch.last_BTH)
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(4, steps, dtype=torch.float64)
    for j in range(steps):
        if j == 1:
            later_BT = torch.zeros(B, T, dtype=torch.bool, device=dev)
            for i in range(1, steps):
                later_BT |= counted_at(i)
            idx_BM, row_valid_BM = later_step_positions(later_BT)
            hidden = gather_rows(hidden, idx_BM)
            causal_BMT = torch.arange(T, device=dev)[None, None] <= idx_BM[..., None]
            mask_BQT = causal_BMT if mask0_BTT is None else gather_rows(mask0_BTT, idx_BM)
        # 2. step j reads the token x[t+1+j] and the previous step's hidden, at position t+j
        hidden = head.step(at(ids, 1 + j), hidden, at(positions_BT, 0) + j, attend, depth=j)
        logits_BMV = head.logits(hidden, depth=j)
        # 3. its target is the teacher at t+1+j predicting x[t+2+j], counted only inside one document,
        #    trained only where the draft vocab covers it
        counted_BM = counted_at(j) & row_valid_BM
        teacher_idx_BM = (idx_BM + 1 + j).clamp(max=T - 1)
        trained_BM = counted_BM & gather_rows(teacher.covered_BT, teacher_idx_BM)
        per_pos = loss_fn(logits_BMV, gather_rows(teacher.logp_BTV, teacher_idx_BM))
        n = trained_BM.sum().clamp(min=1)
        step_loss = (per_pos * trained_BM).sum() / n
        total = total + step_weight**j * step_loss
        # 4. metrics on every counted position (coverage misses count as misses)
        with torch.no_grad():
            q_BMV = torch.softmax(logits_BMV.float(), -1)
            draft_argmax = head.draft_to_target(logits_BMV.argmax(-1))
            hit = (draft_argmax == gather_rows(teacher.argmax_BT, teacher_idx_BM)) & counted_BM
            accept = torch.minimum(q_BMV, gather_rows(teacher.p_full_BTV, teacher_idx_BM)).sum(-1) * counted_BM
            c = counted_BM.sum()
            stats[:, j] = torch.stack([step_loss.detach().double() * c, hit.sum().double(),
                                       accept.sum().double(), c.double()]).cpu()
    count = stats[3].clamp(min=1)
    return TTTResult(total, stats[0] / count, stats[1] / count, stats[2] / count, stats[3])
