"""Capture the target's hidden states into the feature store: the capture stage of train.py, alone.

python data_prep/capture.py +exp=smoke
accelerate launch --multi_gpu --num_processes 8 data_prep/capture.py +exp=llama8b
"""

import logging
import sys

import hydra
from omegaconf import DictConfig

from specdistill.capture.run import BadSamples, run
from specdistill.capture.store import FeatureStoreError
from specdistill.config import ConfigError, register, to_run_config
from specdistill.pipeline import LazyTarget
from specdistill.target import TargetNotFound

register()
log = logging.getLogger("specdistill")


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = to_run_config(dict_cfg)
        result = run(cfg, LazyTarget(cfg))
    except (ConfigError, TargetNotFound, BadSamples, FeatureStoreError) as err:
        log.error("%s", err)
        sys.exit(2)
    log.info("capture: %s", result)


if __name__ == "__main__":
    main()
