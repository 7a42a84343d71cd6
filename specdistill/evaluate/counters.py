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


def served_summary(result: dict, plain: dict) -> dict:
    """One engine run of a head (`run_worker`'s result) beside the plain run on the same prompts: tau, acceptance per
    position, tokens/s, how many outputs equal plain decoding's, and each prompt's counters."""
    counters, new_tokens = result["counters"], sum(len(o) for o in result["outputs"])
    return {"tau": round(tau_of(counters), 4), "drafts": counters["drafts"],
            "acceptance_per_pos": [round(a / max(1, counters["drafts"]), 4) for a in counters["accepted_per_pos"]],
            "tokens_per_s": round(new_tokens / result["wall_s"], 2),
            "outputs_equal_plain": sum(a == b for a, b in zip(result["outputs"], plain["outputs"])),
            "weight_warnings": result["weight_warnings"], "per_prompt": result["per_prompt"]}
