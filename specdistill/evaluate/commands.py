"""`commands/evaluate.py`: evaluate any head (a checkpoint or an export) on any target and benchmark.

Its config (`conf/acceptance.yaml`) composes the same `target` and `eval` groups as `train.py`;
the top-level `head_dir` (given as `head=<dir>` on the command line: see `head_override`), `bench`, `limit`, `max_new_tokens` and `out` are the everyday knobs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from specdistill.cli import run_as_one_job
from specdistill.config import EvalConfig, RunConfig, TargetConfig, WandbConfig, validate
from specdistill.distributed import launch_device, leave_launch
from specdistill.evaluate.engine import (
    engine_evaluation,
    engine_summary_line,
    evaluate_in_engine,
    served_exports,
)
from specdistill.evaluate.run import evaluate, load_any_head
from specdistill.heads.checkpoint import HEAD_CONFIG
from specdistill.target import check_capture_layers, load_target, resolve_source, served_dir

log = logging.getLogger(__name__)


@dataclass
class AcceptanceConfig:
    head_dir: str = MISSING  # a checkpoint dir (head_config.json) or an exported EAGLE-3 dir (config.json)
    bench: str = "spec_bench"
    limit: int = 16
    max_new_tokens: int = 128
    out: str = "acceptance"
    engine: str | None = None  # vllm: serve the head in the engine too (eval.engine.name); commands/engine.py sets it
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def head_override(argv: list[str]) -> list[str]:
    """`head=<dir>` becomes `head_dir=<dir>`: in `conf/` `head` is the config group train.py selects heads
    with, and Hydra would read `head=` as a choice in that group."""
    return [f"head_dir={a[len('head='):]}" if a.startswith("head=") else a for a in argv]


def register() -> None:
    ConfigStore.instance().store(name="acceptance_schema", node=AcceptanceConfig)


def to_run_config(dict_cfg: DictConfig) -> tuple[AcceptanceConfig, RunConfig]:
    """The typed script config and the RunConfig the package reads, validated."""
    cfg: AcceptanceConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AcceptanceConfig), dict_cfg))
    cfg.eval.bench, cfg.eval.limit, cfg.eval.max_new_tokens = cfg.bench, cfg.limit, cfg.max_new_tokens
    cfg.eval.engine.name = cfg.engine or cfg.eval.engine.name
    run = RunConfig(name="acceptance", seed=cfg.seed, out=cfg.out, target=cfg.target, eval=cfg.eval, wandb=cfg.wandb)
    validate(run)
    if not Path(cfg.head_dir).is_dir():
        raise FileNotFoundError(f"config field `head_dir` (head=): {cfg.head_dir} is not a directory (a checkpoint or an export)")
    return cfg, run


def main(dict_cfg: DictConfig) -> dict | None:
    """Evaluate the head; under `accelerate launch --num_processes N` the ranks share the prompts and rank 0
    prints and returns the report (the other ranks return None)."""
    cfg, run = to_run_config(dict_cfg)
    return run_as_one_job(Path(cfg.out) / "failed", lambda: _evaluate(cfg, run))


def _evaluate(cfg: AcceptanceConfig, run: RunConfig) -> dict | None:
    check_capture_layers(run.target, resolve_source(run.target))
    target = load_target(run.target, launch_device())
    log.info("evaluating head %s on %s (%s, %d prompts)", cfg.head_dir, target.name, cfg.bench, cfg.limit)
    report = evaluate(run, target, load_any_head(cfg.head_dir, target), Path(cfg.out), cfg.head_dir)
    leave_launch()
    if report is None:
        return None
    lossless = report["lossless_mismatches"]
    baselines = ", ".join(f"{name} {b['tau']:.2f}" for name, b in report["baselines"].items()) or "none run"
    print(f"tau {report['tau']:.2f} (baselines: {baselines}), speedup {report['speedup']:.2f}x, "
          f"lossless mismatches {lossless}")
    print(f"report: {Path(cfg.out) / 'report.json'}\nsummary: {Path(cfg.out) / 'summary.md'}")
    return report


def main_engine(dict_cfg: DictConfig) -> dict:
    """`commands/engine.py`: only the engine evaluation. A checkpoint is exported in each layout the engine loads;
    an export is served as it is (a speculators export with its verifier pointed at the local target)."""
    cfg, run = to_run_config(dict_cfg)
    check_capture_layers(run.target, resolve_source(run.target))
    target = load_target(run.target, launch_device())
    head, out = load_any_head(cfg.head_dir, target), Path(cfg.out)
    if (Path(cfg.head_dir) / HEAD_CONFIG).exists():
        report = evaluate_in_engine(run.eval, run.export.dtype, run.target, target, head, out)
    else:
        target_dir = served_dir(run.target)
        report = engine_evaluation(run.eval.engine, run.eval, target, head,
                                   served_exports(Path(cfg.head_dir), target_dir, out), target_dir, out)
    print(engine_summary_line(report))
    print(f"report: {out / 'engine.json'}")
    return report
