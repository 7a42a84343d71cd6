"""Export a trained head for serving engines.

    python scripts/export.py ckpt=runs/smollm2/ckpt/best formats=[sglang,vllm,speculators,trtllm] out=exported \
        verifier=HuggingFaceTB/SmolLM2-135M-Instruct
    python scripts/export.py ckpt=runs/glm/ckpt/best formats=[native_mtp] out=exported verifier=<target checkpoint dir>
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from specdistill.cli import exit_on_user_error, run_main
from specdistill.export.run import export_checkpoint


@hydra.main(config_path="../conf", config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    checkpoint = cfg.verifier if cfg.verifier and Path(cfg.verifier).is_dir() else None  # a native MTP export's target
    paths = exit_on_user_error(lambda: export_checkpoint(cfg.ckpt, list(cfg.formats), cfg.out, cfg.dtype, cfg.verifier,
                                                         cfg.speculative_tokens, checkpoint))
    for fmt, path in paths.items():
        print(f"{fmt}: {path}")


if __name__ == "__main__":
    run_main(main)
