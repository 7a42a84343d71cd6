"""Benchmark prompts: the packaged Spec-Bench questions, any jsonl with `turns`, `prompt` or `messages`,
or a column of a local HF dataset (`hf:<name or dir>:<split>:<column>`).

An item is the list of its user turns. Every benchmark is split once, here: rows 2, 7, 12, ... (every
fifth) are the frozen **test** split, which headline numbers come from and no choice of a default ever reads;
the rest are **dev**, where defaults are chosen. The evaluated slice is `limit` items spread evenly over the
file (Spec-Bench groups rows by category), a dev pick that falls on a test row moving to the row after it, or
spread over the test rows for `split="test"`; `held_out_prompts` gives dev rows outside that slice, for the
in-training evaluation, so a head is never chosen on the prompts it is finally scored on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from specdistill.io import read_jsonl

PACKAGED = {"spec_bench": Path(__file__).parent / "benchmarks" / "spec_bench.jsonl"}
HF_PREFIX = "hf:"


class BenchError(ValueError):
    """A benchmark file or row cannot be used; the message names the file and row."""


def user_turns(value, where: str) -> list[str]:
    """The user turns of one row (a dict with `turns` / `prompt` / `messages`) or one column value
    (a string, a list of strings, or a list of chat messages)."""
    if isinstance(value, dict):
        for key in ("turns", "prompt", "messages"):
            if value.get(key):
                return user_turns(value[key], f"{where}: field `{key}`")
        raise BenchError(f"{where}: expected a non-empty `turns`, `prompt` or `messages` field, got keys {sorted(value)}")
    if isinstance(value, str) and value.strip():
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        turns = [m.get("content") for m in value if m.get("role") == "user"]
        if turns and all(isinstance(t, str) for t in turns):
            return turns
    raise BenchError(f"{where}: expected a prompt string, a list of turns or chat messages with user turns, "
                     f"got {type(value).__name__} {str(value)[:80]!r}")


def _hf_rows(spec: str) -> list[list[str]]:
    """`hf:<name or dir>:<split>:<column>`, loaded from the local disk or HF cache only."""
    parts = spec[len(HF_PREFIX):].rsplit(":", 2)
    if len(parts) != 3 or not all(parts):
        raise BenchError(f"benchmark {spec!r}: expected hf:<name or dir>:<split>:<column>")
    name, split, column = parts
    import datasets

    try:
        if (Path(name) / "dataset_dict.json").exists() or (Path(name) / "state.json").exists():
            data = datasets.load_from_disk(name)
            data = data[split] if isinstance(data, datasets.DatasetDict) else data
        else:
            data = datasets.load_dataset(name, split=split, download_mode="reuse_cache_if_exists")
    except Exception as err:
        raise FileNotFoundError(f"benchmark {spec!r}: cannot load split {split!r} of {name!r} locally ({err})") from err
    if column not in data.column_names:
        raise BenchError(f"benchmark {spec!r}: no column {column!r}; columns are {data.column_names}")
    return [user_turns(v, f"{spec} row {i}") for i, v in enumerate(data[column])]


def _load(bench: str) -> tuple[list[list[str]], list[str | None]]:
    """Every item of a benchmark as its list of user turns, and its `category` (None where a row has none)."""
    if bench.startswith(HF_PREFIX):
        items = _hf_rows(bench)
        return items, [None] * len(items)
    path = PACKAGED.get(bench, Path(bench))
    if not path.exists():
        raise FileNotFoundError(
            f"benchmark {bench!r}: no such file; expected one of {list(PACKAGED)}, a jsonl path or "
            "hf:<name or dir>:<split>:<column>"
        )
    rows = read_jsonl(path)
    if not rows:
        raise BenchError(f"benchmark {path}: the file holds no rows")
    items = [user_turns(row, f"{path}:{i + 1}") for i, row in enumerate(rows)]
    return items, [row.get("category") if isinstance(row.get("category"), str) else None for row in rows]


def load_items(bench: str) -> list[list[str]]:
    """Every item of a benchmark, each as its list of user turns."""
    return _load(bench)[0]


SPLITS = ("dev", "test")
TEST_EVERY, TEST_OFFSET = 5, 2  # the test split: rows i with i % 5 == 2


def is_test_row(i: int) -> bool:
    return i % TEST_EVERY == TEST_OFFSET


def spread(rows: list[int], limit: int) -> list[int]:
    stride = max(1, len(rows) // limit)
    return rows[::stride][:limit]


def evaluated_indices(num_items: int, limit: int, split: str = "dev") -> list[int]:
    """The `limit` rows a `split` evaluation reads (see the module docstring)."""
    rows = [i for i in range(num_items) if is_test_row(i) == (split == "test")]
    if split == "test" or num_items // limit < 2:  # a moved dev pick could land on the next one: spread dev rows
        return spread(rows, limit)
    picked = [i + 1 if is_test_row(i) else i for i in spread(list(range(num_items)), limit)]
    return [i for i in picked if i < num_items]


def load_prompts(bench: str, limit: int, max_turns: int = 1,
                 split: str = "dev") -> tuple[list[list[str]], list[str | None]]:
    """`limit` items of `split` spread evenly over the benchmark, each cut to its first `max_turns` turns, and
    their categories (Spec-Bench's task: writing, translation, summarization, ...; None where a row has none)."""
    if split not in SPLITS:
        raise BenchError(f"config field `eval.split`: {split!r}, expected one of {list(SPLITS)}")
    items, categories = _load(bench)
    picked = evaluated_indices(len(items), limit, split)
    return [items[i][:max_turns] for i in picked], [categories[i] for i in picked]


def held_out_prompts(bench: str, limit: int, count: int) -> list[str]:
    """`count` first turns from dev rows NOT in the `limit`-item evaluated slice, spread over the file."""
    items = load_items(bench)
    evaluated = set(evaluated_indices(len(items), limit))
    rest = [i for i in range(len(items)) if i not in evaluated and not is_test_row(i)]
    return [items[i][0] for i in spread(rest, count)]


def turn_batches(items: list[list[str]], batch_size: int) -> Iterator[tuple[int, list[int]]]:
    """(turn, item indices) in batches, turn by turn: an item's later turn is asked after its earlier answer."""
    for turn in range(max(len(it) for it in items)):
        todo = [i for i, it in enumerate(items) if len(it) > turn]
        for start in range(0, len(todo), batch_size):
            yield turn, todo[start : start + batch_size]


def conversation_ids(tokenizer, turns: list[str], answers: list[str]) -> list[int]:
    """Token ids of user turns interleaved with the target's earlier answers, ready for the next answer."""
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]
