"""Start an EAGLE-3 head with a copying attention head, so that it need not discover copying itself.

One decoder layer learns slowly to copy from its context, yet copy rounds (summaries, RAG answers,
repetitions) are where prompt lookup beats a head. The step at position t is given token x[t+1] and
must predict x[t+2]; if x[t+1] occurred earlier at position j, x[j+1] is a good guess, and one attention
head can fetch it. So, before training, the first query head of each key/value group is set to:

- key at j: the identity of x[j], read linearly from the captured target features (a least-squares fit
  on a few training samples) in whitened coordinates of the normalised embedding, written into the
  fused hidden state by `fc`;
- query at t: the same coordinates of the embedding of x[t+1], the token the step is given;
- both on rotary's slowest dimensions only, where the rotation over a context barely moves the match;
- value at j: the embedding of x[j+1] (what the step at j is given), which `o_proj` writes back into
  the residual along a direction the lm_head ranks that token first in.

Each group matches on other coordinates. Training then adjusts everything (with
`head.copy_slow_pairs_only`, all but the copy queries' other rotary pairs: `keep_copy_queries_on_slow_pairs`);
the rest of the layer keeps its random start, and the random part of `fc` is scaled down so the decoded
identity leads at first.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specdistill.heads.eagle3 import Eagle3Head
from specdistill.heads.fit import gram, ridge_solve

SLOW_SHARE = 3 / 8  # of the rotary pairs, the slowest, used for the match (12 of 32 at head_dim 64)
MATCH_SCALE = 1.0  # on queries and keys: a soft start that training sharpens
FC_RANDOM_SCALE = 0.1  # the random part of fc, beside the decoded token identity


def slow_dims(head_dim: int) -> list[int]:
    """Head dims of rotary's slowest SLOW_SHARE of pairs (both halves of each pair)."""
    half = head_dim // 2
    pairs = max(1, int(half * SLOW_SHARE))
    return list(range(half - pairs, half)) + list(range(head_dim - pairs, head_dim))


def fast_dims(head_dim: int) -> list[int]:
    """The other head dims: the rotary pairs a position-free copy query leaves at zero."""
    slow = set(slow_dims(head_dim))
    return [d for d in range(head_dim) if d not in slow]


def copy_query_heads(head: Eagle3Head) -> list[int]:
    """The copy heads: the first query head of each key/value group."""
    arch = head.config.arch
    return list(range(0, arch.num_attention_heads, arch.num_attention_heads // arch.num_key_value_heads))


def whitened_basis(normed_VD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Principal directions [D, D] of the normalised embedding rows, widest first, and their spreads [D]."""
    mean_D = normed_VD.mean(0, dtype=torch.float64)
    spread2, directions = torch.linalg.eigh(gram(normed_VD) / len(normed_VD) - torch.outer(mean_D, mean_D))
    return directions.flip(1), spread2.flip(0).clamp_min(0).sqrt()


def readout_map(normed_VD: torch.Tensor, head: Eagle3Head) -> torch.Tensor:
    """[D, D] map from a token's normalised embedding to a hidden state the lm_head ranks that token
    first in: the least-squares fit, over the draft vocabulary, to the lm_head row whitened by the rows'
    second moment (so that no row wins by its norm alone)."""
    rows_ND = head.lm_head.weight
    inputs_ND = normed_VD[head.draft_to_target(torch.arange(len(rows_ND), device=rows_ND.device))]
    whitening = torch.linalg.inv(gram(rows_ND) / len(rows_ND))
    return ridge_solve(gram(inputs_ND), gram(inputs_ND, rows_ND) @ whitening)


def token_readout(samples: Iterable[dict[str, torch.Tensor]], normed_VD, coords_DM) -> tuple[torch.Tensor, float]:
    """[A, M] least-squares map from the captured features at a position to the coordinates of its
    token's normalised embedding, and the fit's R^2; accumulated a sample at a time."""
    M = coords_DM.shape[1]
    gram_AA = cross_AM = 0
    sum_M, sq_M, n = torch.zeros(M, dtype=torch.float64), torch.zeros(M, dtype=torch.float64), 0
    for s in samples:
        wanted_TM = normed_VD[s["input_ids"].long().cpu()].double() @ coords_DM
        aux_TA = s["aux"]
        gram_AA = gram_AA + gram(aux_TA)
        cross_AM = cross_AM + gram(aux_TA, wanted_TM.to(aux_TA.device))
        sum_M, sq_M, n = sum_M + wanted_TM.sum(0), sq_M + wanted_TM.pow(2).sum(0), n + len(wanted_TM)
    readout_AM = ridge_solve(gram_AA, cross_AM)
    residual = sq_M.sum() - 2 * (readout_AM * cross_AM).sum() + (readout_AM * (gram_AA @ readout_AM)).sum()
    return readout_AM, float(1 - residual / (sq_M.sum() - (sum_M.pow(2) / n).sum()))


def low_rank(map_DD: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """map ~ in [D, rank] @ out [rank, D], by truncated SVD."""
    u, s, vh = torch.linalg.svd(map_DD)
    return u[:, :rank] * s[:rank], vh[:rank]


@torch.no_grad()
def init_copy_attention(head: Eagle3Head, samples: Iterable[dict[str, torch.Tensor]],
                        match_scale: float = MATCH_SCALE) -> float:
    """Set the copy heads of `head` (on the CPU) from `samples` (input_ids [T], aux [T, A] on any device,
    read once); returns the R^2 of the token read-out. A perfect match scores about
    match_scale^2 * (matched coordinates) / sqrt(head_dim) logits: 3 at the default on SmolLM2."""
    if not isinstance(head, Eagle3Head) or head.embed_tokens.weight.requires_grad:
        raise ValueError("config field `head.copy_init`: needs an EAGLE-3 head as wide as the target (it "
                         "reads the target's embedding); set head.copy_init=false")
    arch = head.config.arch
    D, E, K = arch.hidden_size, arch.head_dim, arch.num_key_value_heads
    slow = slow_dims(E)
    m = len(slow)

    normed = head.midlayer.input_layernorm(head.embed_tokens.weight)  # what the query reads
    directions, spread = whitened_basis(normed)
    match_DM = directions[:, : K * m] / spread[: K * m]  # whitened coordinates: x @ match_DM
    value_in_DR, value_out_RD = low_rank(readout_map(normed, head), K * E)

    # the read-out is fitted on what fc reads: the features through the head's per-layer norms, where it has them
    fc_inputs = ({**s, "aux": head.fc_input(s["aux"].to(head.fc.weight))} for s in samples)
    readout_AM, fit_r2 = token_readout(fc_inputs, normed, match_DM)

    fc = head.fc.weight.double()
    orth = torch.linalg.qr(match_DM).Q
    fc = FC_RANDOM_SCALE * (fc - orth @ (orth.T @ fc)) + torch.linalg.pinv(match_DM.T) @ readout_AM.T
    head.fc.weight.copy_(fc)

    attn = head.midlayer.self_attn
    for g, q_head in enumerate(copy_query_heads(head)):
        coords = (match_scale * match_DM[:, g * m:(g + 1) * m].T).float()  # [m, D]
        key_rows = [g * E + d for d in slow]
        attn.k_proj.weight[key_rows] = torch.cat([torch.zeros_like(coords), coords], dim=1)
        attn.q_proj.weight[q_head * E:(q_head + 1) * E] = 0
        attn.q_proj.weight[[q_head * E + d for d in slow], :D] = coords
        attn.v_proj.weight[g * E:(g + 1) * E] = 0
        attn.v_proj.weight[g * E:(g + 1) * E, :D] = value_in_DR[:, g * E:(g + 1) * E].T.float()
        attn.o_proj.weight[:, q_head * E:(q_head + 1) * E] = value_out_RD[g * E:(g + 1) * E].T.float()
    return fit_r2


def keep_copy_queries_on_slow_pairs(head: Eagle3Head) -> torch.utils.hooks.RemovableHandle:
    """Zero the gradient of the copy heads' query rows outside rotary's slowest pairs, for all of training.

    Those rows start at zero, and with no gradient AdamW never moves them (weight decay keeps zero at
    zero), so the copy match stays nearly blind to distance: trained freely, the copy queries put weight
    on the fast pairs and copy badly from beyond the longest training sample. The weights
    stay a plain EAGLE-3 layer: engines see no difference."""
    E = head.config.arch.head_dim
    weight = head.midlayer.self_attn.q_proj.weight
    mask = torch.ones_like(weight)
    for q_head in copy_query_heads(head):
        mask[[q_head * E + d for d in fast_dims(E)]] = 0

    def zero_fast_pairs(grad: torch.Tensor) -> torch.Tensor:
        nonlocal mask
        mask = mask.to(grad)  # moved once: the head reaches its device after this hook is set
        return grad * mask

    return weight.register_hook(zero_fast_pairs)
