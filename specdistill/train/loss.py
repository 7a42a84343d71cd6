"""Per-position losses between the draft's logits and the teacher's distribution on the draft vocab.

Each returns [B, T]; the TTT unroll masks and averages. Shapes: B batch, T tokens, V draft vocab.
"""

from __future__ import annotations

import torch


class SoftCrossEntropy(torch.autograd.Function):
    """-sum_v p_v log q_v = logsumexp(z) - sum_v p_v z_v (p sums to 1); gradient softmax(z) - p.

    Keeps only the logits and the teacher's log-probs (both alive anyway) for backward, instead of
    autograd's fp32 log_softmax and p copies: two [B, T, V] fp32 tensors less per TTT step.
    """

    @staticmethod
    def forward(ctx, logits_BTV, teacher_logp_BTV):
        ctx.save_for_backward(logits_BTV, teacher_logp_BTV)
        z = logits_BTV.float()
        return torch.logsumexp(z, -1) - (teacher_logp_BTV.exp() * z).sum(-1)

    @staticmethod
    def backward(ctx, grad_BT):
        logits_BTV, teacher_logp_BTV = ctx.saved_tensors
        grad_BTV = (torch.softmax(logits_BTV.float(), -1) - teacher_logp_BTV.exp()) * grad_BT[..., None]
        return grad_BTV.to(logits_BTV.dtype), None


def forward_kl(logits_BTV, teacher_logp_BTV):
    """KL(p_target || q_draft) up to the target's entropy: soft cross-entropy (EAGLE-3's loss)."""
    return SoftCrossEntropy.apply(logits_BTV, teacher_logp_BTV)


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
