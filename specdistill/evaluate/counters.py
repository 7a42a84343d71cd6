"""The engine's speculative-decoding counters, as its metrics keep them, and ours in the same form."""

from __future__ import annotations

COUNTED = ("drafts", "accepted", "accepted_per_pos")  # the counters both sides keep


def chain_counters(rounds: list[int], k: int) -> dict:
    """The engine's counters from accepted drafts per round: rounds, accepted tokens, accepted per position."""
    return {"drafts": len(rounds), "accepted": sum(rounds),
            "accepted_per_pos": [sum(a > p for a in rounds) for p in range(k)]}


def same_counts(a: dict, b: dict) -> bool:
    return all(a[key] == b[key] for key in COUNTED)


def tau_of(counters: dict) -> float:
    """1 + accepted / drafts: the engine's mean acceptance length, our tau."""
    return 1 + counters["accepted"] / counters["drafts"] if counters["drafts"] else 1.0
