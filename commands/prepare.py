"""Run the prepare stage alone, with the same Hydra config as `train.py`:

    python commands/prepare.py                                   # self-synthesis on the embedded target
    python commands/prepare.py data.source=jsonl data.path=chats.jsonl data.regenerate=false out=data/
"""

import logging

import hydra
from omegaconf import DictConfig

from specdistill.cli import exit_on_user_error, run_as_one_job, run_main
from specdistill.config import register, to_run_config
from specdistill.data.prepare import run
from specdistill.distributed import leave_launch
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget
from specdistill.target import resolve_source

register()
log = logging.getLogger("specdistill")


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    cfg = exit_on_user_error(lambda: to_run_config(dict_cfg))
    exit_on_user_error(lambda: resolve_source(cfg.target))
    summary = run_as_one_job(RunLayout.of(cfg, "prepare").failed_dir,
                             lambda: run(cfg, RunLayout.of(cfg, "prepare"), LazyTarget(cfg.target)))
    leave_launch()
    log.info("prepared %d samples (%d rejects) in %s", summary["samples"], summary["rejects"], RunLayout.of(cfg, "prepare").data_dir)


if __name__ == "__main__":
    run_main(main)
