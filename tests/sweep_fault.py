"""Launched by test_sweep: `train.py -m ...` (a sweep) killed with SIGKILL right after the first checkpoint of
the job whose run name contains VICTIM, as a machine loss would kill it.

    sweep_fault.py VICTIM OVERRIDES..."""

import os
import runpy
import signal
import sys
from pathlib import Path

from specdistill.train.checkpoint import CheckpointManager

ROOT = Path(__file__).resolve().parents[1]


def main(victim: str, overrides: list[str]) -> None:
    save = CheckpointManager.save

    def save_then_die(self, step, *args, **kwargs):
        save(self, step, *args, **kwargs)
        if victim in self.run_name:
            os.kill(os.getpid(), signal.SIGKILL)

    CheckpointManager.save = save_then_die
    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
