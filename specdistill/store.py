"""The store: stage outputs kept by what made them, shared by every run under one run root (`RunLayout`).

A run reads the prepared data and the features of its settings from `<run_root>/store/`; the first run that
needs an entry builds it, holding the entry's lock, so two jobs never build the same entry at once (the second
waits, then reuses it). Each run lists the entries it read in its `inputs.json`. Entries no run lists any more
can go:

    python -m specdistill.store                 # every entry: its size and the runs that read it
    python -m specdistill.store --prune         # remove the entries no run reads
    python -m specdistill.store --root <run_root>
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
KINDS = ("data", "features")


@contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Hold `<entry>.lock` (an exclusive `flock`, released when the process ends, killed or not)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f"{entry.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another job is building %s: waiting for it, then reusing what it built", entry)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def entries(root: Path) -> list[Path]:
    return sorted(p for kind in KINDS for p in (root / "store" / kind).glob("*") if p.is_dir())


def readers(root: Path) -> dict[Path, list[str]]:
    """Each entry some run's inputs.json lists -> the names of those runs."""
    out: dict[Path, list[str]] = {}
    for inputs in sorted(root.glob("*/inputs.json")):
        for entry in json.loads(inputs.read_text()).values():
            out.setdefault((root / entry).resolve(), []).append(inputs.parent.name)
    return out


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs"), help="the run root (run_root=, default runs)")
    parser.add_argument("--prune", action="store_true", help="remove the entries no run reads")
    args = parser.parse_args()
    used = readers(args.root)
    for entry in entries(args.root):
        runs = used.get(entry.resolve(), [])
        print(f"{entry.relative_to(args.root)}  {size_of(entry) / 2**20:9.1f} MiB  read by: {', '.join(runs) or '-'}")
        if args.prune and not runs:
            with entry_lock(entry):
                shutil.rmtree(entry)
            (entry.parent / f"{entry.name}.lock").unlink(missing_ok=True)
            print(f"  removed {entry}")


if __name__ == "__main__":
    main()
