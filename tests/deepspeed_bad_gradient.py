"""Launched by test_train under `accelerate launch`: a DeepSpeed run in which one micro-batch's gradient is
made non-finite on rank 1 only; the step must be skipped on every rank. Usage: RUN_DIR OVERRIDES..."""

import json
import sys
from pathlib import Path

from test_train import compose_cfg

from specdistill.distributed import leave_launch, rank_and_world
from specdistill.layout import RunLayout
from specdistill.redact import redacted
from specdistill.target import load_target
from specdistill.train.trainer import Trainer

POISONED_CALL = 2  # the second micro-batch: an accumulation boundary when train.grad_accum=2


def main(run_dir: Path, overrides: list[str]) -> None:
    cfg = compose_cfg(run_dir, *overrides)
    trainer = Trainer(cfg, RunLayout.of(cfg), load_target(cfg.target))
    rank, world = rank_and_world()
    calls = 0

    def poison(grad):
        nonlocal calls
        calls += 1
        return grad * float("inf") if rank == 1 and calls == POISONED_CALL else grad

    trainer.head.fc.weight.register_hook(poison)
    trainer.fit(redacted(cfg))
    report = {"world": world, "skipped": trainer.state.skipped, "steps": trainer.state.step}
    (run_dir / f"bad-gradient-rank-{rank}.json").write_text(json.dumps(report))
    leave_launch()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
