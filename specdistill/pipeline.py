"""Run the chosen stages in order, sharing one loaded target between them.

Each stage is `run(cfg, layout, target) -> dict` in its own module (export gets the chain the dev evaluation
advises in place of the target); it reads only the artifacts of earlier stages, found through the run's
`RunLayout`, so any stage can be re-run alone (`stages=[evaluate]`).

Under `accelerate launch --num_processes N` every rank runs this loop. Prepare, capture, train and evaluate
share their work between the ranks inside the stage; export runs on rank 0 alone. The ranks meet after every
stage, so a stage starts only when the one before it is done everywhere, and only rank 0 has the results
(the other ranks return None).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from specdistill.config import RunConfig, TargetConfig
from specdistill.distributed import (
    is_main_rank,
    launch_device,
    leave_launch,
    rank_and_world,
    wait_for_everyone,
)
from specdistill.evaluate.advice import advised_chain
from specdistill.fingerprint import check_head_is_current
from specdistill.heads.checkpoint import check_head_fits_target, load_head
from specdistill.io import write_json
from specdistill.layout import RunLayout
from specdistill.redact import redacted
from specdistill.store import entry_lock
from specdistill.target import Target, bf16_is_native, check_against_target, load_target, resolve_source

log = logging.getLogger(__name__)

STAGE_ENTRIES = {
    "prepare": "specdistill.data.prepare",
    "capture": "specdistill.capture.run",
    "train": "specdistill.train.trainer",
    "evaluate": "specdistill.evaluate.run",
    "export": "specdistill.export.run",
}
RANK0_ONLY = ("export",)
class LazyTarget:
    """Loads the target on first use, so stages that do not need it (export) start at once."""

    def __init__(self, target_cfg: TargetConfig):
        self.target_cfg = target_cfg
        self._target: Target | None = None

    def get(self) -> Target:
        if self._target is None:
            t0 = time.time()
            self._target = load_target(self.target_cfg, launch_device())
            log.info("loaded target %s (%d layers, capture %s) on %s in %.1fs", self._target.name,
                     self._target.config.num_hidden_layers, self._target.layer_ids, self._target.model.device,
                     time.time() - t0)
            if not bf16_is_native(self._target.model.device):
                log.warning("this CPU only emulates bf16 (no AVX512-BF16 or AMX): dtype `auto` (regeneration, training) "
                            "runs fp32 here, several times slower than on a CPU with either or on a GPU")
        return self._target


def check_kept_head(cfg: RunConfig, layout: RunLayout, target: LazyTarget, stage: str) -> None:
    """The head evaluate or export takes from ckpt/ was trained on this run's data and settings and (evaluate,
    which loads the target anyway) fits this target: else the stage stops before it scores or ships a stale head."""
    head_dir = layout.trained_head_dir()
    check_head_is_current(head_dir, cfg, layout)
    if stage == "evaluate":
        check_head_fits_target(load_head(head_dir), target.get(), head_dir)


@contextmanager
def building_entry(stage: str, layout: RunLayout) -> Iterator[None]:
    """Prepare and capture build a store entry: rank 0 holds its lock while every rank works on it, so another job
    that needs the same entry waits and then reuses it."""
    entry = {"prepare": layout.data_dir, "capture": layout.features_dir}.get(stage)
    if entry is None or layout.out_stage == stage:
        yield
        return
    with entry_lock(entry) if is_main_rank() else nullcontext():
        wait_for_everyone()
        yield
        wait_for_everyone()


def run_stages(cfg: RunConfig) -> dict[str, dict] | None:
    check_against_target(cfg, resolve_source(cfg.target))  # fail before any work
    layout = RunLayout.of(cfg)
    rank, world = rank_and_world()
    if rank == 0:
        write_json(layout.config_file, redacted(cfg))
        write_json(layout.inputs_file, {"data": os.path.relpath(layout.data_dir, cfg.run_root),
                                        "features": os.path.relpath(layout.features_dir, cfg.run_root)})
    target = LazyTarget(cfg.target)
    results = {}
    for stage in cfg.stages:
        t0 = time.time()
        log.info("stage %s: start", stage)
        if rank != 0 and stage in RANK0_ONLY:
            log.info("stage %s: rank 0 runs it; rank %d of %d waits", stage, rank, world)
        else:
            if stage in ("evaluate", "export"):
                check_kept_head(cfg, layout, target, stage)
            with building_entry(stage, layout):
                entry = importlib.import_module(STAGE_ENTRIES[stage]).run
                # export gets the evaluation's advice from here, so it never reads evaluate's report: evaluate uses
                # export (to serve its exports in the engine) and nothing runs the other way
                stage_input = advised_chain(layout.report_file) if stage == "export" else target
                results[stage] = entry(cfg, layout, stage_input) or {}
        wait_for_everyone()
        if rank == 0:
            results[stage]["seconds"] = round(time.time() - t0, 3)
        log.info("stage %s: done in %.1fs", stage, time.time() - t0)
    if rank == 0:
        write_json(layout.summary_file, results)
    leave_launch()
    return results if rank == 0 else None
