"""specdistill: prepare -> capture -> train -> evaluate -> export, driven by Hydra.

    python train.py                       # the embedded default (SmolLM2-135M-Instruct) on CPU
    python train.py +exp=smoke            # a tiny random target, every stage in under a minute
    accelerate launch train.py +exp=llama8b
    python train.py stages=[evaluate] eval.limit=32
"""

import logging
import sys

import hydra
from omegaconf import DictConfig

from specdistill.config import ConfigError, register, to_run_config
from specdistill.pipeline import run_stages
from specdistill.summary import print_summary
from specdistill.target import TargetNotFound

register()
log = logging.getLogger("specdistill")


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_run_config(dict_cfg)
        results = run_stages(cfg)
    except (ConfigError, TargetNotFound) as err:
        log.error("%s", err)
        sys.exit(2)
    print_summary(cfg, results)


if __name__ == "__main__":
    main()
