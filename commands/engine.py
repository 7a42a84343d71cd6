"""The exported head served by a real engine (vLLM): its own counters beside our chain drafter's.

    python commands/engine.py head=runs/smollm2/ckpt/best engine=vllm limit=16 out=engine_eval
    python commands/engine.py head=runs/smollm2/export/vllm eval.engine.num_speculative_tokens=2
    python commands/engine.py head=<dir> eval.engine.dtype=bfloat16 eval.engine.python=<interpreter with vllm>

A checkpoint is exported in each layout of `eval.engine.layouts`; an export directory is served as it is.
Writes `<out>/engine.json` (engine tau and ours, per-position counts, speeds, lossless check) and each engine
run's log under `<out>/engine/`. `make engine` installs vLLM's CPU build into `.engine/`.
"""

import sys

import hydra
from omegaconf import DictConfig

from specdistill.cli import exit_on_user_error, run_main
from specdistill.evaluate.commands import head_override, main_engine, register

register()


@hydra.main(config_path="../conf", config_name="engine", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    exit_on_user_error(lambda: main_engine(dict_cfg))


if __name__ == "__main__":
    sys.argv = head_override(sys.argv)
    run_main(main)
