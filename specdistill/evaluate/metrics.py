"""Acceptance metrics from verification rounds: tau, per-depth acceptance, tau split by whether the
round starts on a token copied from the context, bootstrap intervals over prompts, and the drafter's
top-w coverage per depth (what the serving-advice model extrapolates from)."""

from __future__ import annotations

import numpy as np

BOOTSTRAP_DRAWS = 2000


def tau(accepted: list[int]) -> float:
    """Mean over verification rounds of (accepted draft tokens + 1): tokens per target forward."""
    return sum(a + 1 for a in accepted) / max(1, len(accepted))


def _prompt_totals(accepted: list[int], prompt_of_round: list[int], prompts: int) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: tokens produced (accepted + 1 summed over its rounds) and its number of rounds."""
    idx = np.asarray(prompt_of_round, dtype=np.int64)
    tokens = np.bincount(idx, weights=np.asarray(accepted, dtype=np.float64) + 1, minlength=prompts)
    return tokens, np.bincount(idx, minlength=prompts).astype(np.float64)


def tau_intervals(accepted: dict[str, list[int]], prompt_of_round: dict[str, list[int]], prompts: int,
                  reference: str, seed: int, level: float = 0.95) -> dict[str, dict]:
    """Bootstrap over prompts (the unit that varies between benchmarks): for each drafter, the `level`
    interval of its tau and, for the others, of the ratio tau(reference) / tau(drafter), each draw
    resampling the same prompts for every drafter (a paired comparison)."""
    draws = _draws(prompts, seed)
    taus = {name: _drawn_taus(*_prompt_totals(accepted[name], prompt_of_round[name], prompts), draws)
            for name in accepted}
    out = {name: {"tau_ci": _interval(t, level)} for name, t in taus.items()}
    for name in accepted:
        if name != reference:
            ratio = np.divide(taus[reference], taus[name], out=np.zeros(BOOTSTRAP_DRAWS), where=taus[name] > 0)
            out[name]["head_ratio_ci"] = _interval(ratio, level)
    return out


def counters_tau_ratio(a: list[dict], b: list[dict], seed: int, level: float = 0.95) -> dict:
    """tau(a) / tau(b) from two drafters' per-prompt engine counters (`drafts`, `accepted`) on the same prompts,
    with its `level` interval by the paired bootstrap over prompts."""
    if len(a) != len(b):
        raise ValueError(f"paired counters: {len(a)} prompts against {len(b)}")
    draws = _draws(len(a), seed)
    sides = [(np.array([c["drafts"] + c["accepted"] for c in side], dtype=np.float64),
              np.array([c["drafts"] for c in side], dtype=np.float64)) for side in (a, b)]
    taus = [_drawn_taus(tokens, rounds, draws) for tokens, rounds in sides]
    ratio = np.divide(taus[0], taus[1], out=np.zeros(BOOTSTRAP_DRAWS), where=taus[1] > 0)
    (tokens_a, rounds_a), (tokens_b, rounds_b) = sides
    point = (tokens_a.sum() / max(1, rounds_a.sum())) / (tokens_b.sum() / max(1, rounds_b.sum()))
    return {"ratio": round(float(point), 4), "ratio_ci": _interval(ratio, level), "tau_ci": [_interval(t, level) for t in taus]}


def _draws(prompts: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, prompts, size=(BOOTSTRAP_DRAWS, prompts))


def _drawn_taus(tokens: np.ndarray, rounds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    return tokens[draws].sum(1) / np.maximum(rounds[draws].sum(1), 1)


def _interval(x: np.ndarray, level: float) -> list[float]:
    tail = (1 - level) / 2 * 100
    return [round(float(v), 3) for v in np.percentile(x, [tail, 100 - tail])]


def accept_per_depth(accepted: list[int], depth: int) -> list[float]:
    """Share of verification rounds whose accepted path reached depth d, for d = 1..depth."""
    rounds = max(1, len(accepted))
    return [sum(a >= d for a in accepted) / rounds for d in range(1, depth + 1)]


def accept_per_depth_conditional(accepted: list[int], depth: int) -> list[float]:
    """P(path reaches depth d | it reached depth d - 1), for d = 1..depth (0 where no round got there)."""
    reached = [len(accepted)] + [sum(a >= d for a in accepted) for d in range(1, depth + 1)]
    return [reached[d] / reached[d - 1] if reached[d - 1] else 0.0 for d in range(1, depth + 1)]


def repeated_trigrams(tokens: list[int]) -> list[bool]:
    """Per token: does it complete a 3-gram already earlier in `tokens`? There the context holds what
    follows, for prompt lookup or a copying head to draft."""
    seen: set[tuple[int, ...]] = set()
    repeats = [False] * len(tokens)
    for q in range(2, len(tokens)):
        gram = tuple(tokens[q - 2 : q + 1])
        repeats[q] = gram in seen
        seen.add(gram)
    return repeats


def copy_rounds(prompt_ids: list[int], output_ids: list[int], accepted: list[int]) -> list[bool]:
    """Per verification round: does its first new token complete a 3-gram already in the context (prompt
    and output so far)? Those rounds are where copying from the context pays most."""
    tokens = list(prompt_ids) + list(output_ids)
    repeats = repeated_trigrams(tokens)
    flags, q = [], len(prompt_ids)
    for a in accepted:
        flags.append(q < len(tokens) and repeats[q])
        q += a + 1
    return flags


def coverage(hits: list[tuple[int, int, int]], min_rounds: int = 1) -> list[list[float]]:
    """coverage[d - 1][w - 1] = P(the target's token is among the drafter's top-w tokens at depth d |
    the path reached depth d - 1), from rounds whose parent was ranked at least w deep. A row ends at
    the first width ranked in fewer than `min_rounds` rounds: deep, wide cells rest on a handful of
    rounds, and a lucky 1.0 there would inflate every tree that reads it.
    hits: (depth, tokens the drafter ranked at the accepted parent, the target token's rank or -1)."""
    if not hits:
        return []
    max_depth = max(d for d, _, _ in hits)
    table = []
    for d in range(1, max_depth + 1):
        at_depth = [(c, r) for dd, c, r in hits if dd == d]
        widths = max((c for c, _ in at_depth), default=0)
        row = []
        for w in range(1, widths + 1):
            offered = [r for c, r in at_depth if c >= w]
            if len(offered) < min_rounds:
                break
            row.append(sum(0 <= r < w for r in offered) / len(offered))
        table.append(row)
    return table
