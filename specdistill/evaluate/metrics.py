"""Acceptance metrics from verification rounds: tau, per-depth acceptance, tau split by whether the
round starts on a token copied from the context, and the drafter's top-w coverage per depth (what the
serving-advice model extrapolates from)."""

from __future__ import annotations


def tau(accepted: list[int]) -> float:
    """Mean over verification rounds of (accepted draft tokens + 1): tokens per target forward."""
    return sum(a + 1 for a in accepted) / max(1, len(accepted))


def accept_per_depth(accepted: list[int], depth: int) -> list[float]:
    """Share of verification rounds whose accepted path reached depth d, for d = 1..depth."""
    rounds = max(1, len(accepted))
    return [sum(a >= d for a in accepted) / rounds for d in range(1, depth + 1)]


def accept_per_depth_conditional(accepted: list[int], depth: int) -> list[float]:
    """P(path reaches depth d | it reached depth d - 1), for d = 1..depth (0 where no round got there)."""
    reached = [len(accepted)] + [sum(a >= d for a in accepted) for d in range(1, depth + 1)]
    return [reached[d] / reached[d - 1] if reached[d - 1] else 0.0 for d in range(1, depth + 1)]


def copy_rounds(prompt_ids: list[int], output_ids: list[int], accepted: list[int]) -> list[bool]:
    """Per verification round: does its first new token complete a 3-gram already in the context (prompt
    and output so far)? Those rounds are where copying from the context pays most."""
    tokens = list(prompt_ids) + list(output_ids)
    seen: set[tuple[int, ...]] = set()
    repeats = [False] * len(tokens)
    for q in range(2, len(tokens)):
        gram = tuple(tokens[q - 2 : q + 1])
        repeats[q] = gram in seen
        seen.add(gram)
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
