"""Per-batch teacher features from the frozen target: what a store sample holds, computed on the fly.

The online mode calls this inside the training loop; the offline capture calls the same function
and writes its result to shards, so both modes train on identical tensors.

Legend: B batch, T tokens (right-padded), H target hidden size, A = len(layer_ids) * H, V target
vocabulary, K teacher top-k.
"""

from __future__ import annotations

import torch

from specdistill.target_runner import TargetRunner

TEACHERS = ("last", "topk")


def topk_teacher(logits_BTV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probabilities of the full-vocabulary distribution (fp32) and their token ids (int32)."""
    if not 1 <= k <= logits_BTV.shape[-1]:
        raise ValueError(f"capture.teacher_topk={k}: must be in [1, {logits_BTV.shape[-1]}] (the vocabulary)")
    logits_BTV = logits_BTV.float()
    top = logits_BTV.topk(k, dim=-1)
    logprobs_BTK = top.values - logits_BTV.logsumexp(dim=-1, keepdim=True)
    return logprobs_BTK, top.indices.to(torch.int32)


@torch.inference_mode()
def capture_batch(
    runner: TargetRunner,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    teacher: str = "last",
    teacher_topk: int = 32,
) -> dict[str, torch.Tensor]:
    """One frozen forward -> {"aux": [B, T, A], "last": [B, T, H]} or, with teacher="topk",
    {"aux", "topk_logprobs": [B, T, K] fp32, "topk_ids": [B, T, K] int32}; padded positions are garbage."""
    if teacher not in TEACHERS:
        raise ValueError(f"capture.teacher={teacher!r}: expected one of {list(TEACHERS)}")
    out = runner(input_ids_BT, attention_mask_BT, with_logits=teacher == "topk")
    if teacher == "last":
        return {"aux": out.aux_BTA, "last": out.last_BTH}
    logprobs_BTK, ids_BTK = topk_teacher(out.logits_BTV, teacher_topk)
    return {"aux": out.aux_BTA, "topk_logprobs": logprobs_BTK, "topk_ids": ids_BTK}
