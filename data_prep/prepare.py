"""Run the prepare stage alone, with the same Hydra config as `train.py`:

    python data_prep/prepare.py                                   # self-synthesis on the embedded target
    python data_prep/prepare.py data.source=jsonl data.path=chats.jsonl data.regenerate=false out=data/
"""

import logging
import sys

import hydra
from omegaconf import DictConfig

from specdistill.config import ConfigError, register, to_run_config
from specdistill.data.prepare import data_dir_of, run
from specdistill.data.rejects import TooManyRejects
from specdistill.pipeline import LazyTarget
from specdistill.target import TargetNotFound, resolve_source

register()
log = logging.getLogger("specdistill")


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_run_config(dict_cfg)
        resolve_source(cfg.target)
        summary = run(cfg, LazyTarget(cfg))
    except (ConfigError, TargetNotFound, TooManyRejects, FileNotFoundError, ValueError) as err:
        log.error("%s", err)
        sys.exit(2)
    log.info("prepared %d samples (%d rejects) in %s", summary["samples"], summary["rejects"], data_dir_of(cfg))


if __name__ == "__main__":
    main()
