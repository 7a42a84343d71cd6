"""Export a trained head for serving engines.

    python scripts/export.py ckpt=runs/smollm2/ckpt/best formats=[sglang,vllm,speculators,trtllm] out=exported
"""

import logging
import sys

import hydra
from omegaconf import DictConfig

from specdistill.export.common import ExportError
from specdistill.export.run import export_checkpoint

log = logging.getLogger("specdistill")


@hydra.main(config_path="../conf", config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        paths = export_checkpoint(cfg.ckpt, list(cfg.formats), cfg.out, cfg.dtype, cfg.target)
    except (ExportError, FileNotFoundError) as err:
        log.error("%s", err)
        sys.exit(2)
    for fmt, path in paths.items():
        print(f"{fmt}: {path}")


if __name__ == "__main__":
    main()
