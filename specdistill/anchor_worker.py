"""Runs vLLM's `speculators` trainer, its own code with its own defaults, on a CPU; imports nothing of ours.

    PYTHONPATH=.interop python anchor_worker.py <steps.jsonl> <speculators train arguments...>

speculators 0.9.0 assumes an accelerator in two places: its trainer moves the model to `get_local_rank()` (a GPU
index) and its step timer calls `torch.accelerator.synchronize()`. On a CPU the first becomes "cpu" and the second
does nothing. Each optimizer step's metrics (its loss and its own step timing) are appended to <steps.jsonl> as
the trainer logs them, so a killed run still leaves the steps it made.
"""

import json
import sys

import torch


class StepRecorder:
    """speculators' metrics logger, and a copy of each step's record in a JSON-lines file."""

    def __init__(self, logger, path: str):
        self.logger, self.file = logger, open(path, "a")

    def info(self, record, *args, **kwargs):
        if isinstance(record, dict) and "global_step" in record:
            self.file.write(json.dumps(record, default=float) + "\n")
            self.file.flush()
        self.logger.info(record, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.logger, name)


def main() -> None:
    steps_path, argv = sys.argv[1], sys.argv[2:]
    import speculators.train.trainer as trainer
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    trainer.metric_logger = StepRecorder(trainer.metric_logger, steps_path)
    train_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main()
