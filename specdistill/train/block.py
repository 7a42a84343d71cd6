"""DFlash's objective: block denoising, drafted as vLLM drafts it.

Every position a whose next token is one the head should learn anchors a block: the token x[a] (what the bonus
slot holds when serving) then `steps` mask tokens, at positions a .. a+steps. The block attends to its own slots
in both directions and to the context of positions before a in the same document (their captured layers; the
target has run those, not a). Slot k is trained toward the target's distribution at a+k-1, the one that chose
x[a+k], weighted step_weight**(k-1), where x[a+k] is a loss token of a's document: the same targets, coverage and
metrics as the TTT unroll's step k-1 (`ttt.TTTResult`), so the trainer and its curves take either.

Blocks are laid out per row, a row's anchors' slots side by side, so one attention call per layer serves the batch
(`dflash.blockwise_attention`: each block's own keys apart from the context's). Shapes: B batch, T tokens, R anchors per row (padded), Q = R * (steps + 1) slots,
S = T + Q keys, M trained slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdistill.heads.dflash import blockwise_attention
from specdistill.train.teacher import TeacherTargets
from specdistill.train.ttt import TTTBatch, TTTResult, padded_documents


def unroll_block(head, batch: TTTBatch, teacher: TeacherTargets, steps: int, step_weight: float,
                 loss_fn: Callable) -> TTTResult:
    ids, dev = batch.input_ids_BT, batch.input_ids_BT.device
    B, T = ids.shape
    doc_BT = batch.doc_BT if batch.doc_BT is not None else padded_documents(batch.valid_BT)
    positions_BT = batch.position_ids_BT if batch.position_ids_BT is not None else torch.arange(T, device=dev).expand(B, T)
    width = steps + 1

    def counted(k: int) -> torch.Tensor:
        """[B, T]: x[a+k] is a loss token of a's document."""
        out = torch.zeros(B, T, dtype=torch.bool, device=dev)
        out[:, : T - k] = (batch.loss_mask_BT[:, k:] > 0) & (doc_BT[:, k:] == doc_BT[:, : T - k]) & (doc_BT[:, :T - k] >= 0)
        return out

    # 1. anchors: positions whose first mask slot has a target, R per row at most (rows padded with position 0)
    anchor_BT = counted(1)
    R = max(int(anchor_BT.sum(1).max()), 1)
    order_BT = torch.sort((~anchor_BT).to(torch.int8), dim=1, stable=True).indices  # anchors first, in order
    anchors_BR, real_BR = order_BT[:, :R], torch.gather(anchor_BT, 1, order_BT[:, :R])

    # 2. the block: x[a] then masks at positions pos[a] + k; it sees its own slots and context keys p < a of a's
    #    document (padding anchors see only their own block)
    slot_W = torch.arange(width, device=dev)
    tokens_BRW = head.block_input(ids.gather(1, anchors_BR).flatten(), width).view(B, R, width)
    positions_BRW = positions_BT.gather(1, anchors_BR)[..., None] + slot_W
    doc_BR = doc_BT.gather(1, anchors_BR)
    sees_BRT = ((torch.arange(T, device=dev) < anchors_BR[..., None]) & (doc_BT[:, None] == doc_BR[..., None])
                & real_BR[..., None])
    attend = blockwise_attention(sees_BRT.repeat_interleave(width, 1), width)
    hidden_BQD = head.block(tokens_BRW.view(B, -1), positions_BRW.view(B, -1),
                            head.context_kv(batch.aux_BTA, positions_BT), attend)
    hidden_BRWD = hidden_BQD.view(B, R, width, -1)

    # 3. slot k (1..steps) learns the teacher row a+k-1, where x[a+k] counts
    total = hidden_BQD.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(4, steps, dtype=torch.float64)
    for k in range(1, width):
        trained_BR = torch.gather(counted(k), 1, anchors_BR) & real_BR
        b, r = trained_BR.nonzero(as_tuple=True)
        rows = anchors_BR[b, r] + k - 1
        logits_1MV = head.logits(hidden_BRWD[b, r, k])[None]
        covered_1M = teacher.covered_BT[b, rows][None]
        per_pos = loss_fn(logits_1MV, teacher.logp_BTV[b, rows][None])
        step_loss = (per_pos * covered_1M).sum() / covered_1M.sum().clamp(min=1)
        total = total + step_weight ** (k - 1) * step_loss
        with torch.no_grad():
            hit = head.draft_to_target(logits_1MV.argmax(-1)) == teacher.argmax_BT[b, rows][None]
            accept = torch.minimum(torch.softmax(logits_1MV.float(), -1), teacher.p_full_BTV[b, rows][None]).sum(-1)
            c = len(rows)
            stats[:, k - 1] = torch.stack([step_loss.detach().double() * c, hit.sum().double(),
                                           accept.sum().double(), torch.tensor(float(c), device=dev).double()]).cpu()
    count = stats[3].clamp(min=1)
    return TTTResult(total, stats[0] / count, stats[1] / count, stats[2] / count, stats[3])
