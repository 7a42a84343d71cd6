"""Launched by test_learning: `train.py` with the teacher off by one position (each position distilled towards the
target's distribution one token early), the alignment bug a broken teacher or loss most often is.

    learning_fault.py OVERRIDES..."""

import runpy
import sys
from pathlib import Path

from specdistill.train import loss

ROOT = Path(__file__).resolve().parents[1]


def main(overrides: list[str]) -> None:
    aligned = loss.LOSSES["forward_kl"]
    loss.LOSSES["forward_kl"] = lambda logits_BTV, teacher_logp_BTV: aligned(logits_BTV, teacher_logp_BTV.roll(1, 1))
    sys.argv = [str(ROOT / "train.py"), *overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
