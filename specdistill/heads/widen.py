"""Serve a head over more draft tokens than it was trained on.

Training over N draft tokens keeps the teacher's softmax and the lm_head small, but a token outside
them can never be drafted, and copy rounds meet such tokens often (names, numbers, a prompt's rare
words). After training, the head's lm_head rows are very nearly the target's rows for the same tokens
through one shared linear map (on SmolLM2, a least-squares map reproduces the trained rows with cosine
0.97, and rows held out of the fit with 0.98, where the target's rows as they are agree to 0.69). So
the rows of the added tokens are the target's rows through that map; the trained rows stay as trained.
"""

from __future__ import annotations

import dataclasses

import torch

from specdistill.data.vocab import DraftVocab
from specdistill.heads.checkpoint import head_from_state
from specdistill.heads.fit import gram, ridge_solve


@torch.no_grad()
def widened(head, target_lm_head_VK: torch.Tensor, vocab: DraftVocab):
    """A copy of `head` over `vocab`'s draft tokens (which must include the head's), on the head's
    device, and the mean cosine between the fitted map's rows and the trained ones."""
    device, dtype = head.lm_head.weight.device, head.lm_head.weight.dtype
    trained_ids_N = head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=device)).cpu()
    outside = int((~vocab.t2d_V[trained_ids_N]).sum())
    if outside:
        raise ValueError(f"the wider draft vocabulary ({vocab.size} tokens) leaves out {outside} of the head's "
                         f"{len(trained_ids_N)} trained tokens; build it from the same token counts")
    trained_ND = head.lm_head.weight.detach().float().cpu()
    target_VK = target_lm_head_VK.detach().float().cpu()
    sources_NK = target_VK[trained_ids_N]
    map_KD = ridge_solve(gram(sources_NK), gram(sources_NK, trained_ND))
    fit_cos = torch.nn.functional.cosine_similarity((sources_NK.double() @ map_KD).float(), trained_ND, dim=1)

    wide_ids_W = vocab.target_ids_N
    lm_head_WD = (target_VK[wide_ids_W].double() @ map_KD).float()
    position_V = torch.full((len(vocab.t2d_V),), -1, dtype=torch.int64)
    position_V[wide_ids_W] = torch.arange(vocab.size)
    lm_head_WD[position_V[trained_ids_N]] = trained_ND

    state = {k: v.detach().cpu() for k, v in head.trainable_state_dict().items()}
    state.update({"lm_head.weight": lm_head_WD.to(dtype), "d2t": vocab.d2t_N.to(state["d2t"].dtype),
                  "t2d": vocab.t2d_V.to(state["t2d"].dtype)})
    config = dataclasses.replace(head.config, draft_vocab_size=vocab.size)
    return head_from_state(config, state, "the widened head").to(device), float(fit_cos.mean())
