"""A resumable cache of generated conversations, keyed by a hash of everything that determines them.

Append-only JSON lines, flushed and fsynced per write: a killed run loses at most the line being
written, and a torn last line is ignored on reading, so the next run regenerates exactly that work.
Each rank appends to its own file and reads every rank's file, so ranks never write the same file.
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


class ConversationCache:
    def __init__(self, directory: str | Path, rank: int = 0):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"conversations.rank{rank}.jsonl"
        self.entries: dict[str, dict] = {}
        self.reload()

    def reload(self) -> None:
        """Read every rank's file; lines cut short by a killed writer are skipped."""
        for path in sorted(self.directory.glob("conversations.rank*.jsonl")):
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    try:
                        entry = json.loads(line)
                        self.entries[entry["key"]] = entry["value"]
                    except (json.JSONDecodeError, KeyError):
                        log.warning("%s:%d: skipping an incomplete cache line (an interrupted write)", path, line_no)
        if self.entries:
            log.info("conversation cache %s: %d finished entries", self.directory, len(self.entries))

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, value: dict) -> None:
        line = json.dumps({"key": key, "value": value}, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            if f.tell() > 0:
                self._end_torn_line(f)
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.entries[key] = value

    def _end_torn_line(self, f) -> None:
        """Start on a fresh line if the previous writer was killed mid-line."""
        with open(self.path, "rb") as r:
            r.seek(-1, os.SEEK_END)
            if r.read(1) != b"\n":
                f.write("\n")
