"""Hydra sweeps (`python train.py -m ...`): one run per job, named from its overrides, and a table at the end.

Each job of a sweep runs the whole pipeline under its own run name, `<name>-<key>@<value>+...` from its
overrides (sorted, those that say how the sweep runs left out; `name=` sets the prefix), so a rerun of the same
sweep command finds every job's run again and resumes it. The jobs read the prepared data and features from the
run root's store (`RunLayout`): a sweep over head or training settings prepares and captures once. The task
function returns the job's dev tau, what a sweeper (Optuna: `+sweep=optuna`) maximises. When the sweep ends,
`SweepTable` writes `sweep.md` and `sweep.json` into the sweep directory (`<run_root>/sweeps/<name>/`): each job's
overrides, dev tau with its interval, the tau vLLM served where the engine ran, the stage times, and the best job
marked.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from specdistill.io import write_json, write_table

log = logging.getLogger(__name__)
# overrides that say how a sweep runs, not what its jobs differ in: they stay out of the jobs' names
NOT_IN_NAME = ("exp", "name", "run_root", "sweep", "hydra", "wandb")


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def job_overrides() -> list[str]:
    """This job's own overrides (`key=value`), those of NOT_IN_NAME left out."""
    kept = []
    for override in HydraConfig.get().overrides.task:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.split(".")[0].split("/")[0] not in NOT_IN_NAME:
            kept.append(override)
    return kept


def job_name(base: str) -> str:
    """`<base>-<key>@<value>+...` for a job of a sweep, else `base`. The name is one directory and stays a plain
    value in a later override (`head=runs/<name>/ckpt/best`): `=` and `,` would be read as Hydra syntax, so they
    become `@` and `+`, and any other character outside [A-Za-z0-9_.@+-] becomes `_`."""
    overrides = job_overrides() if in_multirun() else []
    if not overrides:
        return base
    joined = "+".join(o.lstrip("+~").replace("=", "@", 1) for o in sorted(overrides))
    return f"{base}-{re.sub(r'[^A-Za-z0-9_.@+-]', '_', joined)}"


def named_for_its_job(cfg: DictConfig) -> DictConfig:
    """`cfg` with its run name made the job's own when it is a job of a sweep."""
    if in_multirun():
        cfg.name = job_name(cfg.name)
    return cfg


class SweepTable(Callback):
    """Each job records itself in `<sweep dir>/jobs/`; at the end of the sweep the table is written from them and
    from each run's `summary.json` (files, so jobs may run elsewhere: submitit, SLURM)."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if not in_multirun():
            return
        hydra = HydraConfig.get()
        run_dir = Path(config.run_root) / job_name(config.name)
        write_json(Path(hydra.sweep.dir) / "jobs" / f"{hydra.job.num}.json",
                   {"num": hydra.job.num, "overrides": job_overrides(), "run_dir": str(run_dir),
                    "status": job_return.status.name})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = [json.loads(p.read_text()) for p in (sweep_dir / "jobs").glob("*.json")]
        rows = sorted((job_row(job) for job in jobs), key=lambda r: r["num"])
        scored = [r for r in rows if r["tau"] is not None]
        best = max(scored, key=lambda r: r["tau"])["num"] if scored else None
        for row in rows:
            row["best"] = row["num"] == best
        write_json(sweep_dir / "sweep.json", rows)
        write_table(sweep_dir / "sweep.md", table_lines(rows))


def job_row(job: dict) -> dict:
    """One job's line of the table, from its run's summary.json (absent: the job did not finish)."""
    path = Path(job["run_dir"]) / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    evaluation = summary.get("evaluate", {})
    layouts = (evaluation.get("engine") or {}).get("layouts", {})
    served = next((m["tau"] for m in layouts.values() if m.get("tau") is not None), None)
    return {"num": job["num"], "overrides": job["overrides"], "run_dir": job["run_dir"], "status": job["status"],
            "tau": evaluation.get("tau"), "tau_ci": evaluation.get("tau_ci"), "served_tau": served,
            "seconds": {stage: result.get("seconds") for stage, result in summary.items()}}


def table_lines(rows: list[dict]) -> list[str]:
    stages = sorted({s for r in rows for s in r["seconds"]}, key=["prepare", "capture", "train", "evaluate",
                                                                   "export"].index)
    lines = ["| job | overrides | dev tau | 95% interval | vLLM tau | " + " | ".join(f"{s} s" for s in stages) + " |",
             "|---|---|---|---|---|" + "---|" * len(stages)]
    for r in rows:
        tau = "-" if r["tau"] is None else f"{r['tau']:.3f}" + (" (best)" if r["best"] else "")
        ci = "-" if not r["tau_ci"] else f"[{r['tau_ci'][0]:.2f}, {r['tau_ci'][1]:.2f}]"
        served = "-" if r["served_tau"] is None else f"{r['served_tau']:.3f}"
        times = " | ".join("-" if r["seconds"].get(s) is None else f"{r['seconds'][s]:.0f}" for s in stages)
        lines.append(f"| {r['num']} | `{' '.join(r['overrides'])}` | {tau} | {ci} | {served} | {times} |")
    return lines
