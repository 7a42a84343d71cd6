"""A resumable cache of finished work (generated conversations, evaluated batches), keyed by a hash of
everything that determines it.

Append-only JSON lines, flushed and fsynced per write: a killed run loses at most the line being
written, and a torn last line is ignored on reading, so the next run regenerates exactly that work.
Each writer (a rank of one job: `rank0`, or `<entry>.rank0` where jobs building different store entries share a
cache) appends to its own file and reads every writer's file, so no two processes write the same file.
Only key -> (file, offset) is held in memory; values are read back from disk when asked for, and
`reload` reads only what the files gained since the last read, so a set larger than memory streams.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def content_key(*parts) -> str:
    """A stable hash of JSON-serialisable parts (row content, sampling params, target name)."""
    blob = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class ResultCache:
    def __init__(self, directory: str | Path, writer: str = "rank0", stem: str = "conversations"):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stem = stem
        self.path = self.directory / f"{stem}.{writer}.jsonl"
        self.index: dict[str, tuple[Path, int]] = {}  # key -> (file, byte offset of its line)
        self._read_up_to: dict[Path, int] = {}  # bytes of each file already indexed (whole lines only)
        self.reload()

    def reload(self) -> None:
        """Index the lines every writer's file gained since the last call; lines cut short by a killed writer
        are skipped, and a last line without its newline is left for a later call."""
        before = len(self.index)
        for path in sorted(self.directory.glob(f"{self.stem}.*.jsonl")):
            offset = self._read_up_to.get(path, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                for line in f:
                    if not line.endswith(b"\n"):
                        break
                    try:
                        self.index[json.loads(line)["key"]] = (path, offset)
                    except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                        log.warning("%s at byte %d: skipping an incomplete cache line (an interrupted write)",
                                    path, offset)
                    offset += len(line)
            self._read_up_to[path] = offset
        if len(self.index) > before:
            log.info("%s cache %s: %d finished entries", self.stem, self.directory, len(self.index))

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def get(self, key: str) -> dict | None:
        where = self.index.get(key)
        if where is None:
            return None
        path, offset = where
        with open(path, "rb") as f:
            f.seek(offset)
            return json.loads(f.readline())["value"]

    def put(self, key: str, value: dict) -> None:
        line = (json.dumps({"key": key, "value": value}, ensure_ascii=False) + "\n").encode("utf-8")
        with open(self.path, "ab") as f:
            if f.tell() > 0:
                self._end_torn_line(f)
            offset = f.tell()
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.index[key] = (self.path, offset)
        if self._read_up_to.get(self.path, 0) == offset:  # nothing unread before it: no need to read it back
            self._read_up_to[self.path] = offset + len(line)

    def _end_torn_line(self, f) -> None:
        """Start on a fresh line if the previous writer was killed mid-line."""
        with open(self.path, "rb") as r:
            r.seek(-1, os.SEEK_END)
            if r.read(1) != b"\n":
                f.write(b"\n")
