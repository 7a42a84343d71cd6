"""Conversation sources: local json/jsonl/parquet/arrow files, `save_to_disk` dirs and HF hub datasets,
read row by row into one shape, `[{"role", "content"}, ...]`, with the row's source position.

Row formats (detected per row unless `data.format` names one):
  sharegpt   {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}
  messages   {"messages": [{"role": "user"|"assistant"|"system", "content": ...}, ...]}  (OpenAI, UltraChat-200k)
  ultrachat  {"data": ["user text", "assistant text", ...]}  (alternating, original UltraChat)
  turns      {"turns": ["user text", ...]}  (Spec-Bench / MT-Bench: user turns only, answers regenerated)

Local jsonl is parsed line by line by us, not by `datasets`' json builder, so one broken line (bad JSON, bytes
that are not UTF-8) becomes a reject naming its line instead of an exception that stops the job or text that
is silently changed; a UTF-8 byte-order mark before the first line is skipped.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets

from specdistill.data.rejects import RowError

log = logging.getLogger(__name__)

ROLES = {
    "user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
}
FORMAT_FIELDS = {"sharegpt": "conversations", "messages": "messages", "ultrachat": "data", "turns": "turns"}
ARROW_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


@dataclass
class SourceRow:
    source: str  # the file or dataset name
    position: str  # where in it: "line 12", "row 3"
    row: dict | None  # None when the raw line could not be parsed
    error: RowError | None = None


def detect_format(row: dict) -> str:
    for fmt, name in FORMAT_FIELDS.items():
        if name in row:
            return fmt
    raise RowError("unknown_format", f"none of the fields {sorted(FORMAT_FIELDS.values())} in row with fields "
                                     f"{sorted(row)[:10]}")


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise RowError("non_string_content", f"{where} is {type(value).__name__}, expected a string")
    if not value.strip():
        raise RowError("empty_content", f"{where} is empty")
    return value


def _role(value, where: str) -> str:
    if not isinstance(value, str) or value.lower() not in ROLES:
        raise RowError("unknown_role", f"{where} is {value!r}, expected one of {sorted(ROLES)}")
    return ROLES[value.lower()]


def _turn_list(row: dict, field: str) -> list:
    turns = row.get(field)
    if not isinstance(turns, list) or not turns:
        raise RowError("missing_field", f"field `{field}` is {type(turns).__name__}, expected a non-empty list")
    return turns


def to_messages(row: dict, fmt: str = "auto") -> list[dict]:
    """The row as chat messages; raises RowError naming the field when it does not fit."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", f"row is {type(row).__name__}, expected an object")
    fmt = detect_format(row) if fmt == "auto" else fmt
    field = FORMAT_FIELDS[fmt]
    turns = _turn_list(row, field)
    if fmt in ("ultrachat", "turns"):
        roles = ["user", "assistant"] * len(turns) if fmt == "ultrachat" else ["user"] * len(turns)
        messages = [{"role": r, "content": _text(t, f"{field}[{i}]")} for i, (r, t) in enumerate(zip(roles, turns))]
    else:
        role_key, text_key = ("from", "value") if fmt == "sharegpt" else ("role", "content")
        messages = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise RowError("malformed_turn", f"{field}[{i}] is {type(turn).__name__}, expected an object")
            if role_key not in turn or text_key not in turn:
                raise RowError("missing_field", f"{field}[{i}] lacks `{role_key}` or `{text_key}`")
            messages.append({"role": _role(turn[role_key], f"{field}[{i}].{role_key}"),
                             "content": _text(turn[text_key], f"{field}[{i}].{text_key}")})
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no_user_turn", "the conversation has no user message")
    return messages


# ---------------------------------------------------------------- reading


def _decoded(raw: bytes) -> str:
    """`raw` as strict UTF-8; bytes that are not UTF-8 reject the row (replacing them would train on text
    that was never written)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RowError("invalid_utf8", f"byte {err.start} ({raw[err.start:err.start + 1]!r}) is not valid UTF-8") \
            from err


def _jsonl_rows(path: Path) -> Iterator[SourceRow]:
    with open(path, "rb") as f:
        first = f.read(len(codecs.BOM_UTF8))
        f.seek(len(codecs.BOM_UTF8) if first == codecs.BOM_UTF8 else 0)
        if path.suffix == ".json" and f.peek(1)[:1] == b"[":  # one JSON array
            try:
                rows = json.loads(_decoded(f.read()))
            except (json.JSONDecodeError, RowError) as err:
                error = err if isinstance(err, RowError) else RowError("invalid_json", str(err))
                yield SourceRow(str(path), "file", None, error)
                return
            for i, row in enumerate(rows):
                yield SourceRow(str(path), f"item {i}", row)
            return
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield SourceRow(str(path), f"line {line_no}", json.loads(_decoded(raw)))
            except RowError as err:
                yield SourceRow(str(path), f"line {line_no}", None, err)
            except json.JSONDecodeError as err:
                yield SourceRow(str(path), f"line {line_no}", None, RowError("invalid_json", str(err)))


def _dataset_rows(name: str, ds) -> Iterator[SourceRow]:
    for i, row in enumerate(ds):
        yield SourceRow(name, f"row {i}", row)


def open_source(path: str, split: str = "train", streaming: bool = False) -> Iterator[SourceRow]:
    """Rows of one source: a local file or dir, else an HF hub dataset name."""
    local = Path(path)
    if local.is_file() and local.suffix in (".json", ".jsonl"):
        return _jsonl_rows(local)
    if local.is_file() and local.suffix in ARROW_BUILDERS:
        ds = datasets.load_dataset(ARROW_BUILDERS[local.suffix], data_files=str(local), split="train",
                                   streaming=streaming)
        return _dataset_rows(str(local), ds)
    if local.is_dir() and (local / "dataset_info.json").exists():
        return _dataset_rows(str(local), datasets.load_from_disk(str(local)))
    if local.is_dir() and (local / "dataset_dict.json").exists():
        return _dataset_rows(str(local), datasets.load_from_disk(str(local))[split])
    if local.exists() and not local.is_dir():
        raise ValueError(f"{local}: unsupported file type {local.suffix!r}; expected .json, .jsonl, "
                         f"{', '.join(ARROW_BUILDERS)} or a `save_to_disk` dir")
    if not local.exists() and (local.suffix in (".json", ".jsonl", *ARROW_BUILDERS) or local.is_absolute()
                               or path.startswith(".")):
        raise FileNotFoundError(f"config field `data.path` (or `data.mix`): {path} does not exist")
    return _dataset_rows(path, datasets.load_dataset(path, split=split, streaming=streaming))


def read_conversations(paths: list[str], fmt: str, split: str = "train", streaming: bool = False,
                       limit: int | None = None) -> Iterator[SourceRow]:
    """Every row of every source, converted to messages in `row` (or with `error` set), up to `limit` rows."""
    count = 0
    for path in paths:
        log.info("reading conversations from %s", path)
        for item in open_source(path, split, streaming):
            if limit is not None and count >= limit:
                return
            count += 1
            if item.error is None:
                try:
                    item.row = {"messages": to_messages(item.row, fmt)}
                except RowError as err:
                    item.error = err
            yield item
