"""The ranks of one job: who this process is, how ranks share work, wait for each other, and fail together.

Rank and world size are read from torch.distributed: accelerate 1.15 reports `0 of 1` under DeepSpeed on CPU
even when DeepSpeed formed a real multi-rank group.

A job under `accelerate launch --num_processes N` fails as one: the first rank to fail writes its error to
`<failed dir>/rank-<R>.json` (a run's `failed/`) before it exits; every other rank, stopped by the launcher (SIGTERM) or by a
collective whose peer went away, names that error in its own last line and exits non-zero too, with the first
failure's exit code.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch

from specdistill.io import write_json

log = logging.getLogger(__name__)
# Ranks that wait while rank 0 alone works (export, the engine check, a report) may wait long: a bigger target's
# engine run can outlast the process group's default 30 minutes, so waits go through a group of their own.
RANK0_WAIT = timedelta(days=2)
_wait_group = None


class Stopped(Exception):
    """The launcher stopped this rank (SIGTERM), most often because another rank failed."""


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def is_main_rank() -> bool:
    return rank_and_world()[0] == 0


def launch_device() -> torch.device:
    """This process's device: its GPU (cuda:<local rank> under `accelerate launch`) when there is one, else
    the CPU. Forms the process group first when the launcher started several processes."""
    from accelerate import PartialState

    return PartialState().device


def join_launch() -> tuple[int, int, torch.device]:
    """(rank, world, device) of this process (stages before training have no Accelerator to form the group).
    Every rank calls it at the same point (it may create a process group, a collective)."""
    global _wait_group
    device = launch_device()
    rank, world = rank_and_world()
    if world > 1 and _wait_group is None:
        _wait_group = torch.distributed.new_group(backend="gloo", timeout=RANK0_WAIT)
    return rank, world, device


def wait_for_everyone() -> None:
    """A barrier with a long timeout (see RANK0_WAIT); nothing to do in a one-process job."""
    if rank_and_world()[1] > 1:
        torch.distributed.barrier(group=_wait_group)


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    world = rank_and_world()[1]
    if world == 1:
        return [obj]
    out = [None] * world
    torch.distributed.all_gather_object(out, obj, group=_wait_group)
    return out


def leave_launch() -> None:
    """Tear the process group down once every rank is done: left to interpreter exit, gloo's threads can
    abort a rank ("terminate called without an active exception") after its work succeeded."""
    global _wait_group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        wait_for_everyone()
        torch.distributed.destroy_process_group()
        _wait_group = None


def _stop_on_sigterm(signum, frame):
    raise Stopped(f"stopped by signal {signum}")


def first_failure(failed_dir: Path) -> dict | None:
    """The earliest failure a rank recorded, if any."""
    records = []
    for path in failed_dir.glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being written; the rank's own log still names it
    return min(records, key=lambda r: r["time"], default=None)


@contextmanager
def failing_together(failed_dir: Path, exit_code_of: Callable[[BaseException], int]) -> Iterator[None]:
    """Run a multi-rank job's work so that one rank's failure ends every rank with that failure named.

    Rank 0 clears earlier failure records before the ranks first meet. A rank that fails records its error with
    `exit_code_of(error)` and re-raises; a rank that fails after another one did (stopped by the launcher, or its
    collective broken by the peer's exit) logs the first failure and exits with its code."""
    rank, world = rank_and_world()
    if world == 1:
        yield
        return
    if rank == 0:
        shutil.rmtree(failed_dir, ignore_errors=True)
    wait_for_everyone()
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        yield
    except BaseException as err:
        first = first_failure(failed_dir)
        if first is not None and first["rank"] != rank:
            log.error("rank %d of %d stops: rank %d failed first: %s", rank, world, first["rank"], first["error"])
            sys.exit(first["exit_code"])
        code = err.code if isinstance(err, SystemExit) else exit_code_of(err)
        if code not in (0, None):
            write_json(failed_dir / f"rank-{rank}.json", {"rank": rank, "time": time.time(), "exit_code": code,
                                                          "error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
