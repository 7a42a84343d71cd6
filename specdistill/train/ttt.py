"""The Training-Time Test: unroll the head k steps on its own outputs, as it will run when drafting.

Step j at position t reads the token x[t+1+j] and the head's step j-1 output at t (step 0 reads the
fused target features), sits at RoPE position t+j, attends causally to step-0 keys and to its own
position's keys from steps 1..j, and is trained toward the target's distribution at t+1+j for the
token x[t+2+j], weighted step_weight**j. In a packed row (several documents) attention stays inside
each document, positions restart per document, and a position is trained only if x[t+2+j] belongs to
its own document, so no shift crosses a document boundary. A P-EAGLE head reads a mask token and its
`mask_hidden` at steps >= 1 instead (`head.step_input`), with the same positions, attention and targets: the
parallel slots vLLM appends after the last committed token. Steps >= 1 run only over the range of
positions some later step trains: a position's later steps read step-0 keys and their own, nothing else.

Shapes: B batch, T tokens, M positions with a target at a step, Q positions run at a step, A aux features, D head hidden,
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


def trained_window(marked_BT: torch.Tensor) -> tuple[int, int]:
    """[lo, hi): the narrowest range of positions holding every marked one in the batch (at least one
    position). A range, not a per-row list, so that every lookup stays a slice: a view, never a copy of
    the [B, T, V] teacher kept for backward."""
    columns = marked_BT.any(0).nonzero()
    return (int(columns[0]), int(columns[-1]) + 1) if len(columns) else (0, 1)


def teacher_rows(batch: TTTBatch) -> torch.Tensor:
    """[B, T] bool: the teacher rows `unroll_ttt` reads. Step j at position t learns x[t+2+j] from the
    teacher's row t+1+j, and only where that token is a loss token: row r is read only if x[r+1] is one."""
    rows_BT = torch.zeros_like(batch.valid_BT)
    rows_BT[:, :-1] = batch.loss_mask_BT[:, 1:] > 0
    return rows_BT


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
    lo, hi = 0, T  # the positions run at this step

    def attend(q, k, v):
        keys.append(attn.expand_kv(k))
        values.append(attn.expand_kv(v))
        return ttt_attention(q, keys, values, mask_BQT)

    def window(x_BT: torch.Tensor, shift: int = 0, fill=0) -> torch.Tensor:
        """x[:, lo + shift : hi + shift], `fill` past the end."""
        part = x_BT[:, lo + shift : hi + shift]
        missing = hi - lo - part.shape[1]
        return torch.cat([part, part.new_full((B, missing), fill)], 1) if missing else part

    def counted_at(j: int) -> torch.Tensor:
        """Positions trained at step j: x[t+2+j] is a loss token of t's own document."""
        doc = window(doc_BT)
        return (window(batch.loss_mask_BT, 2 + j) > 0) & (window(doc_BT, 2 + j, -2) == doc) & (doc >= 0)

    # 1. step 0 runs at every position (every later step attends to its keys); steps >= 1 only over the
    #    range of positions some later step trains (the assistant turns), since a position's later steps
    #    see only step-0 keys and their own: on chat data a long prompt needs step 0 alone.
    hidden = head.initial_hidden(batch.aux_BTA, batch.last_BTH)
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(4, steps, dtype=torch.float64)
    for j in range(steps):
        if j == 1:
            later_BT = torch.zeros(B, T, dtype=torch.bool, device=dev)
            for i in range(1, steps):
                later_BT |= counted_at(i)
            lo, hi = trained_window(later_BT)
            hidden = hidden[:, lo:hi]
            causal_QT = torch.arange(T, device=dev)[None] <= torch.arange(lo, hi, device=dev)[:, None]
            mask_BQT = causal_QT[None] if mask0_BTT is None else mask0_BTT[:, lo:hi]
        # 2. step j reads the token x[t+1+j] and the previous step's hidden (P-EAGLE: the mask token and
        #    fc(mask_hidden), so the step cannot lean on the drafts before it), at position t+j
        tokens_BQ, hidden_in = (window(ids, 1), hidden) if j == 0 else head.step_input(window(ids, 1 + j), hidden, j)
        hidden = head.step(tokens_BQ, hidden_in, window(positions_BT) + j, attend, depth=j)
        # 3. its target is the teacher at t+1+j predicting x[t+2+j], for the M positions t of the range where
        #    that token exists; counted only inside one document, trained only where the draft vocab covers it
        #    (the logits only over the range [a, b) of those positions that some row trains: at step 0 this
        #    skips a long prompt's positions, which no step trains)
        M = max(0, min(hi, T - 2 - j) - lo)
        counted_BM = counted_at(j)[:, :M]
        a, b = trained_window(counted_BM) if counted_BM.any() else (0, 0)
        logits_BMV = head.logits(hidden[:, a:b], depth=j)
        counted_BM = counted_BM[:, a:b]
        rows = slice(lo + 1 + j + a, lo + 1 + j + b)  # the teacher's rows for these positions
        trained_BM = counted_BM & teacher.covered_BT[:, rows]
        per_pos = loss_fn(logits_BMV, teacher.logp_BTV[:, rows])
        n = trained_BM.sum().clamp(min=1)
        step_loss = (per_pos * trained_BM).sum() / n
        total = total + step_weight**j * step_loss
        # 4. metrics on every counted position (coverage misses count as misses)
        with torch.no_grad():
            q_BMV = torch.softmax(logits_BMV.float(), -1)
            draft_argmax = head.draft_to_target(logits_BMV.argmax(-1))
            hit = (draft_argmax == teacher.argmax_BT[:, rows]) & counted_BM
            accept = torch.minimum(q_BMV, teacher.p_full_BTV[:, rows]).sum(-1) * counted_BM
            c = counted_BM.sum()
            stats[:, j] = torch.stack([step_loss.detach().double() * c, hit.sum().double(),
                                       accept.sum().double(), c.double()]).cpu()
    count = stats[3].clamp(min=1)
    return TTTResult(total, stats[0] / count, stats[1] / count, stats[2] / count, stats[3])
