"""Capture the target's hidden states into the feature store: the capture stage of train.py, alone.

python commands/capture.py +exp=smoke
accelerate launch --multi_gpu --num_processes 8 commands/capture.py +exp=llama8b
"""

import logging

import hydra
from omegaconf import DictConfig

from specdistill.capture.run import run
from specdistill.cli import exit_on_user_error, run_as_one_job, run_main
from specdistill.config import register, to_run_config
from specdistill.distributed import leave_launch
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget

register()
log = logging.getLogger("specdistill")


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    cfg = exit_on_user_error(lambda: to_run_config(dict_cfg))
    result = run_as_one_job(RunLayout.of(cfg, "capture").failed_dir,
                            lambda: run(cfg, RunLayout.of(cfg, "capture"), LazyTarget(cfg.target)))
    leave_launch()
    log.info("capture: %s", result)


if __name__ == "__main__":
    run_main(main)
