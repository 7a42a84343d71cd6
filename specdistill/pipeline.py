"""Run the chosen stages in order, sharing one loaded target between them.

Each stage is `run(cfg, target) -> dict` in its own module; it reads only the artifacts of earlier
stages from the run directory, so any stage can be re-run alone (`stages=[evaluate]`).

Under `accelerate launch --num_processes N` every rank runs this loop. Prepare, capture, train and evaluate
share their work between the ranks inside the stage; export runs on rank 0 alone. The ranks meet after every
stage, so a stage starts only when the one before it is done everywhere, and only rank 0 has the results
(the other ranks return None).
"""

from __future__ import annotations

import importlib
import logging
import re
import time

from omegaconf import OmegaConf

from specdistill.config import RunConfig
from specdistill.distributed import launch_device, leave_launch, rank_and_world, wait_for_everyone
from specdistill.fingerprint import check_head_is_current
from specdistill.heads import check_head_fits_target, load_head, trained_head_dir
from specdistill.io import write_json
from specdistill.redact import redact_urls
from specdistill.target import (
    Target,
    bf16_is_native,
    check_against_target,
    load_target,
    resolve_source,
)

log = logging.getLogger(__name__)

STAGE_ENTRIES = {
    "prepare": "specdistill.data.prepare",
    "capture": "specdistill.capture.run",
    "train": "specdistill.train.trainer",
    "evaluate": "specdistill.evaluate.run",
    "export": "specdistill.export.run",
}
RANK0_ONLY = ("export",)
SECRET_FIELD = re.compile(r"(^|_)(token|api_key|key|secret|password)$", re.IGNORECASE)


def scrub_secrets(node):
    """A copy with every secret-looking field (`hf_token`, `api_key`, ...) blanked and every URL's
    user:password and query values hidden (`data.generation.server_url` may carry a key)."""
    if isinstance(node, dict):
        return {k: ("***" if SECRET_FIELD.search(str(k)) and v else scrub_secrets(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [scrub_secrets(v) for v in node]
    if isinstance(node, str):
        return redact_urls(node)
    return node


def redacted(cfg: RunConfig) -> dict:
    """The config as a plain dict, secrets blanked: what is saved in the run dir and sent to W&B."""
    return scrub_secrets(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))


class LazyTarget:
    """Loads the target on first use, so stages that do not need it (export) start at once."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self._target: Target | None = None

    def get(self) -> Target:
        if self._target is None:
            t0 = time.time()
            self._target = load_target(self.cfg.target, launch_device())
            log.info("loaded target %s (%d layers, capture %s) on %s in %.1fs", self._target.name,
                     self._target.config.num_hidden_layers, self._target.layer_ids, self._target.model.device,
                     time.time() - t0)
            if not bf16_is_native(self._target.model.device):
                log.warning("this CPU only emulates bf16 (no AVX512): dtype `auto` (regeneration, training) runs fp32 "
                            "here, several times slower than on a CPU with AMX or AVX512-BF16 or on a GPU")
        return self._target


def check_kept_head(cfg: RunConfig, target: LazyTarget, stage: str) -> None:
    """The head evaluate or export takes from ckpt/ was trained on this run's data and settings and (evaluate,
    which loads the target anyway) fits this target: else the stage stops before it scores or ships a stale head."""
    head_dir = trained_head_dir(cfg.run_dir)
    check_head_is_current(head_dir, cfg)
    if stage == "evaluate":
        check_head_fits_target(load_head(head_dir), target.get(), head_dir)


def run_stages(cfg: RunConfig) -> dict[str, dict] | None:
    check_against_target(cfg, resolve_source(cfg.target))  # fail before any work
    rank, world = rank_and_world()
    if rank == 0:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(cfg.run_dir / "config.json", redacted(cfg))
    target = LazyTarget(cfg)
    results = {}
    for stage in cfg.stages:
        t0 = time.time()
        log.info("stage %s: start", stage)
        if rank != 0 and stage in RANK0_ONLY:
            log.info("stage %s: rank 0 runs it; rank %d of %d waits", stage, rank, world)
        else:
            if stage in ("evaluate", "export"):
                check_kept_head(cfg, target, stage)
            results[stage] = importlib.import_module(STAGE_ENTRIES[stage]).run(cfg, target) or {}
        wait_for_everyone()
        if rank == 0:
            results[stage]["seconds"] = round(time.time() - t0, 1)
        log.info("stage %s: done in %.1fs", stage, time.time() - t0)
    leave_launch()
    return results if rank == 0 else None
