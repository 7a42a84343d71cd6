"""Per-position losses between the draft's logits and the teacher's distribution on the draft vocab.

Each returns [B, T]; the TTT unroll masks and averages. Shapes: B batch, T tokens, V draft vocab.
"""

from __future__ import annotations

import torch


def forward_kl(logits_BTV, teacher_logp_BTV):
    """KL(p_target || q_draft) up to the target's entropy: soft cross-entropy (EAGLE-3's loss)."""
    return -(teacher_logp_BTV.exp() * torch.log_softmax(logits_BTV.float(), -1)).sum(-1)


def reverse_kl(logits_BTV, teacher_logp_BTV):
    logq = torch.log_softmax(logits_BTV.float(), -1)
    return (logq.exp() * (logq - teacher_logp_BTV)).sum(-1)


def hard_ce(logits_BTV, teacher_logp_BTV):
    return torch.nn.functional.cross_entropy(
        logits_BTV.float().flatten(0, 1), teacher_logp_BTV.argmax(-1).flatten(), reduction="none"
    ).view(logits_BTV.shape[:-1])


def total_variation(logits_BTV, teacher_logp_BTV):
    return 0.5 * (torch.softmax(logits_BTV.float(), -1) - teacher_logp_BTV.exp()).abs().sum(-1)


LOSSES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "hard_ce": hard_ce, "tv": total_variation}
