"""The target's next-token distribution, restricted to the draft vocabulary, as training targets.

Full-vocabulary quantities (normaliser, argmax) are computed `chunk` vocabulary columns at a time,
so [batch, seq, target_vocab] fp32 logits never exist at once.

Shapes: B batch, T tokens, H target hidden, V draft vocab, K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class TeacherTargets:
    logp_BTV: torch.Tensor  # log-probs renormalised over the draft vocab (the training target)
    p_full_BTV: torch.Tensor  # the target's full-vocab probability of each draft token (for acceptance)
    argmax_BT: torch.Tensor  # the target's argmax, a target-vocab id
    covered_BT: torch.Tensor  # bool: the argmax is inside the draft vocab


class Teacher:
    """Turns stored target features (last hidden state or top-k log-probs) into TeacherTargets."""

    def __init__(self, final_norm: torch.nn.Module, lm_head_weight: torch.Tensor, d2t: torch.Tensor,
                 t2d: torch.Tensor, chunk: int = 16384):
        self.final_norm = final_norm
        self.lm_head_weight = lm_head_weight  # [target_vocab, H]
        self.draft_ids = torch.arange(len(d2t), device=d2t.device) + d2t  # target id of each draft token
        self.t2d = t2d
        self.chunk = chunk

    @torch.no_grad()
    def from_last(self, last_BTH: torch.Tensor, needed_BT: torch.Tensor) -> TeacherTargets:
        """`needed_BT` (bool, `ttt.teacher_rows`) limits the vocabulary matmul to the rows the loss reads: on
        chat data the prompt rows, nearly half, are never trained. The other rows get a uniform target, zero
        probability and no coverage, so they count as misses wherever they are read."""
        picked = self._targets(last_BTH[needed_BT])
        V = len(self.draft_ids)
        logp = torch.full((*needed_BT.shape, V), -math.log(V), dtype=torch.float32, device=last_BTH.device)
        p_full = torch.zeros_like(logp)
        argmax = torch.zeros(needed_BT.shape, dtype=torch.long, device=last_BTH.device)
        logp[needed_BT], p_full[needed_BT], argmax[needed_BT] = picked.logp_BTV, picked.p_full_BTV, picked.argmax_BT
        return TeacherTargets(logp, p_full, argmax, self.t2d[argmax] & needed_BT)

    def _targets(self, last_H: torch.Tensor) -> TeacherTargets:
        """TeacherTargets for every row of `last_H` ([..., H])."""
        w = self.lm_head_weight
        h = self.final_norm(last_H.to(w.dtype))
        lse = torch.full(h.shape[:-1], float("-inf"), dtype=torch.float32, device=h.device)
        best = torch.full_like(lse, float("-inf"))
        argmax = torch.zeros(h.shape[:-1], dtype=torch.long, device=h.device)
        for start in range(0, w.shape[0], self.chunk):
            logits = (h @ w[start:start + self.chunk].T).float()
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
            chunk_best, chunk_arg = logits.max(dim=-1)
            better = chunk_best > best
            best = torch.where(better, chunk_best, best)
            argmax = torch.where(better, chunk_arg + start, argmax)
        draft_logits = (h @ w[self.draft_ids].T).float()
        return TeacherTargets(
            logp_BTV=torch.log_softmax(draft_logits, dim=-1),
            p_full_BTV=torch.exp(draft_logits - lse[..., None]),
            argmax_BT=argmax,
            covered_BT=self.t2d[argmax],
        )

    @torch.no_grad()
    def from_topk(self, topk_logprobs_BTK: torch.Tensor, topk_ids_BTK: torch.Tensor) -> TeacherTargets:
        """Compact teacher: only the top-k of the target's distribution is known; the rest is zero."""
        ids = topk_ids_BTK.long()
        lp = topk_logprobs_BTK.float()
        t2d_index = torch.full((self.t2d.shape[0],), -1, dtype=torch.long, device=ids.device)
        t2d_index[self.draft_ids] = torch.arange(len(self.draft_ids), device=ids.device)
        slot = t2d_index[ids]  # [B, T, K] draft id or -1
        shape = (*ids.shape[:-1], len(self.draft_ids))
        p_full = torch.zeros(shape, dtype=torch.float32, device=ids.device)
        p_full.scatter_(-1, slot.clamp(min=0), torch.where(slot >= 0, lp.exp(), torch.zeros_like(lp)))
        logp = torch.log(p_full.clamp(min=1e-30))
        logp = torch.where(p_full > 0, logp, torch.full_like(logp, -1e4))
        argmax = ids.gather(-1, lp.argmax(-1, keepdim=True)).squeeze(-1)
        return TeacherTargets(torch.log_softmax(logp, dim=-1), p_full, argmax, self.t2d[argmax])
