"""Benchmark prompts: the packaged Spec-Bench questions or any jsonl with `turns`, `prompt` or `messages`."""

from __future__ import annotations

from pathlib import Path

from specdistill.io import read_jsonl

PACKAGED = {"spec_bench": Path(__file__).parent / "benchmarks" / "spec_bench.jsonl"}


def first_user_turn(row: dict, where: str) -> str:
    if "turns" in row and row["turns"]:
        return row["turns"][0]
    if "prompt" in row:
        return row["prompt"]
    for m in row.get("messages", []):
        if m.get("role") == "user":
            return m["content"]
    raise ValueError(f"{where}: expected a `turns`, `prompt` or `messages` field, got keys {sorted(row)}")


def load_prompts(bench: str, limit: int) -> list[str]:
    """`limit` first-turn prompts spread evenly over the file (Spec-Bench groups rows by category)."""
    path = PACKAGED.get(bench, Path(bench))
    if not path.exists():
        raise FileNotFoundError(f"benchmark {bench!r}: no such file; expected one of {list(PACKAGED)} or a jsonl path")
    rows = read_jsonl(path)
    stride = max(1, len(rows) // limit)
    return [first_user_turn(rows[i], f"{path}:{i + 1}") for i in range(0, len(rows), stride)][:limit]
