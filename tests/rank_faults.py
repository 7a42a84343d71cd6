"""Launched by test_ranks under `accelerate launch`: `train.py` with one fault injected into one rank.

    rank_faults.py FAULT RANK OVERRIDES...

FAULT: `kill` (SIGKILL at the rank's second evaluated batch), `raise` (a user error there), or `export` (a user
error in the export stage, which rank 0 runs while the others wait)."""

import os
import runpy
import signal
import sys
from pathlib import Path

import specdistill.evaluate.run as evaluation
import specdistill.export.run as export_stage
from specdistill.distributed import rank_and_world

ROOT = Path(__file__).resolve().parents[1]


def faulty(original, fault: str, victim: int, at_call: int):
    calls = 0

    def wrapped(*args, **kwargs):
        nonlocal calls
        calls += 1
        if rank_and_world()[0] == victim and calls == at_call:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise FileNotFoundError(f"injected fault on rank {victim}")
        return original(*args, **kwargs)

    return wrapped


def main(fault: str, victim: int, overrides: list[str]) -> None:
    if fault == "export":
        export_stage.export_checkpoint = faulty(export_stage.export_checkpoint, fault, victim, 1)
    else:
        evaluation.decode_batch = faulty(evaluation.decode_batch, fault, victim, 2)
    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
