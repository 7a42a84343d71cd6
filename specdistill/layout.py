"""RunLayout: the one place that names every artifact of a run.

    <run_root>/
      store/                       stage outputs kept by what made them, shared by every run under this root
        cache/                     regeneration and synthesis caches (keyed by content: any entry may reuse them)
        data/<key>/                prepared data: samples/, vocab.safetensors, summary.json, rejects.jsonl
        features/<key>/            captured features: shards + manifest.json
      <name>/                      one run
        config.json                the resolved config, secrets blanked
        summary.json               each stage's result and seconds, from the last command
        inputs.json                the store entries this run read
        ckpt/step-N/ best/ final/  training checkpoints and the heads
        train/                     history.json, curves.png, samples-rank-R.json
        eval/                      report.json, outputs.jsonl, acceptance.png, summary.md, partial/
        export/<format>/           one directory per engine layout
        anchor/                    speculators' own head beside ours (benchmarks/anchor.py): its inputs, its
                                   checkpoints, both served, anchor.json
        failed/rank-R.json         the first failure of a multi-rank job

A store entry's key hashes the settings its output depends on (`data_key`, `features_key`), so runs that
differ only in head, training or evaluation settings read the same entries, and a changed data setting
makes a new entry instead of overwriting one a run still uses. `out=<dir>`, with a single stage in
`stages`, sends that stage's output there instead (the prepared data, the features, the evaluation or the
exports).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from specdistill.cache import content_key
from specdistill.config import CaptureConfig, ConfigError, DataConfig, RunConfig, TargetConfig
from specdistill.data.decontaminate import decontaminated_against
from specdistill.heads.checkpoint import HEAD_CONFIG
from specdistill.io import CorruptFile, verify_checksums

log = logging.getLogger(__name__)

# data fields that change how fast the data is made, not what it holds
DATA_EXECUTION_FIELDS = ("num_proc", "streaming")
GENERATION_EXECUTION_FIELDS = ("chunk_rows", "concurrency", "timeout_s", "max_retries", "retry_backoff_s",
                               "server_url", "python")
CAPTURE_EXECUTION_FIELDS = ("batch_tokens",)


def data_key(data: DataConfig, target: TargetConfig, seed: int, eval_bench: str) -> str:
    """What the prepared data depends on: the data settings, the target, the seed, the benchmark it is
    decontaminated against (`eval_bench`, where it is)."""
    fields = dataclasses.asdict(data)
    for name in DATA_EXECUTION_FIELDS:
        fields.pop(name, None)
    for name in GENERATION_EXECUTION_FIELDS:
        fields["generation"].pop(name, None)
    return content_key("data", fields, target.name, target.revision, target.gguf_file, seed,
                       decontaminated_against(data, eval_bench))


def features_key(data_key: str, capture: CaptureConfig, target: TargetConfig) -> str:
    """What the captured features depend on: the prepared data (its `data_key`), the capture settings, the target
    and its layers."""
    fields = {k: v for k, v in dataclasses.asdict(capture).items() if k not in CAPTURE_EXECUTION_FIELDS}
    return content_key("features", data_key, fields, target.name, target.revision, target.gguf_file, target.dtype,
                       target.capture_layers)


@dataclass(frozen=True)
class RunLayout:
    run_dir: Path
    store_dir: Path
    data_key: str
    features_key: str
    out_stage: str | None = None  # the one stage whose output `out` redirects
    out: Path | None = None

    @classmethod
    def of(cls, cfg: RunConfig, stage: str | None = None) -> RunLayout:
        """The layout of `cfg`'s run; `out` redirects `stage` (a stage run on its own), else the one stage in
        `cfg.stages`."""
        root = Path(cfg.run_root)
        if cfg.out and stage is None:
            if len(cfg.stages) != 1:
                raise ConfigError(f"config field `out`: {cfg.out} is where one stage writes instead, but stages="
                                  f"{list(cfg.stages)}; run that stage alone (stages=[<stage>])")
            stage = cfg.stages[0]
        data = data_key(cfg.data, cfg.target, cfg.seed, cfg.eval.bench)
        return cls(root / cfg.name, root / "store", data, features_key(data, cfg.capture, cfg.target),
                   stage if cfg.out else None, Path(cfg.out) if cfg.out else None)

    def _output(self, stage: str, default: Path) -> Path:
        return self.out if self.out_stage == stage else default

    # ---------------------------------------------------------------- the store
    @property
    def cache_dir(self) -> Path:
        return self._output("prepare", self.store_dir) / "cache"

    @property
    def data_dir(self) -> Path:
        return self._output("prepare", self.store_dir / "data" / self.data_key)

    @property
    def samples_dir(self) -> Path:
        return self.data_dir / "samples"

    @property
    def vocab_file(self) -> Path:
        return self.data_dir / "vocab.safetensors"

    @property
    def data_summary(self) -> Path:
        return self.data_dir / "summary.json"

    @property
    def rejects_file(self) -> Path:
        return self.data_dir / "rejects.jsonl"

    @property
    def features_dir(self) -> Path:
        return self._output("capture", self.store_dir / "features" / self.features_key)

    # ---------------------------------------------------------------- the run's own
    @property
    def config_file(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def summary_file(self) -> Path:
        """What the last command did: each stage's result and seconds (what a sweep's table reads)."""
        return self.run_dir / "summary.json"

    @property
    def inputs_file(self) -> Path:
        return self.run_dir / "inputs.json"

    @property
    def failed_dir(self) -> Path:
        return self.run_dir / "failed"

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "ckpt"

    def step_dir(self, step: int) -> Path:
        return self.ckpt_dir / f"step-{step:07d}"

    @property
    def best_dir(self) -> Path:
        return self.ckpt_dir / "best"

    @property
    def final_dir(self) -> Path:
        return self.ckpt_dir / "final"

    @property
    def train_dir(self) -> Path:
        return self.run_dir / "train"

    @property
    def eval_dir(self) -> Path:
        return self._output("evaluate", self.run_dir / "eval")

    @property
    def report_file(self) -> Path:
        """The run's own evaluation report (not one sent elsewhere with `out=`): where export reads its advice."""
        return self.run_dir / "eval" / "report.json"

    @property
    def export_dir(self) -> Path:
        return self._output("export", self.run_dir / "export")

    @property
    def anchor_dir(self) -> Path:
        return self.run_dir / "anchor"

    def trained_head_dir(self) -> Path:
        """`best/` if training kept one, else `final/`: the head evaluate and export use. A corrupted best/ falls
        back to final/ with a warning; when both are corrupted the error names their files."""
        return trained_head_dir(self.ckpt_dir)


def trained_head_dir(ckpt_dir: Path) -> Path:
    corrupt = []
    for directory in (ckpt_dir / "best", ckpt_dir / "final"):
        if (directory / HEAD_CONFIG).exists():
            try:
                verify_checksums(directory)
                return directory
            except CorruptFile as err:
                log.warning("%s; falling back to the next head checkpoint", err)
                corrupt.append(str(err))
    if corrupt:
        raise CorruptFile(f"no intact head checkpoint: {'; '.join(corrupt)}; run the train stage again")
    raise FileNotFoundError(f"{ckpt_dir}: neither best/ nor final/ holds a head checkpoint; run the train stage first")
