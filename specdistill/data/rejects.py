"""Rows that cannot be used: each is kept with its reason and source position, never silently lost.

A stage collects rejects as it goes and fails only when their share exceeds the configured limit,
so one broken row in a million does not stop a long job, while a wrong format (every row broken) does.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from specdistill.io import write_jsonl
from specdistill.redact import redact_text

log = logging.getLogger(__name__)


# Rows left out on purpose rather than broken: conversations that overlap the evaluation benchmark, and the one
# record a JSON array file cut off at its end holds (at most one per file, whatever its size). They go to
# rejects.jsonl like every other reject but do not count against `data.max_reject_share`: neither says the
# source was read wrong.
NOT_FAILURES = frozenset({"benchmark_overlap", "truncated_record"})


class RowError(ValueError):
    """A row is unusable; `reason` is a short stable key counted in the summary."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TooManyRejects(RuntimeError):
    """More rows were rejected than `data.max_reject_share` allows."""


@dataclass
class RejectLog:
    rows: list[dict] = field(default_factory=list)

    def add(self, source: str, position: int | str, error: RowError, **extra) -> None:
        self.rows.append({"source": source, "position": position, "reason": error.reason,
                          "detail": redact_text(error.detail)[:500], **extra})

    def extend(self, other: RejectLog) -> None:
        self.rows.extend(other.rows)

    def by_reason(self) -> dict[str, int]:
        return dict(Counter(r["reason"] for r in self.rows).most_common())

    def __len__(self) -> int:
        return len(self.rows)

    def write(self, path: Path) -> None:
        write_jsonl(path, self.rows)

    def check_share(self, total: int, max_share: float, where: Path) -> None:
        """Raise when rejects other than NOT_FAILURES exceed `max_share` of `total` rows; the message says where
        to look."""
        failures = sum(r["reason"] not in NOT_FAILURES for r in self.rows)
        share = failures / total if total else 0.0
        if share > max_share:
            raise TooManyRejects(
                f"{failures} of {total} rows rejected ({share:.0%} > data.max_reject_share="
                f"{max_share:.0%}); reasons {self.by_reason()}; see {where}"
            )
        if self.rows:
            log.warning("%d of %d rows rejected (%s); see %s", len(self.rows), total, self.by_reason(), where)
