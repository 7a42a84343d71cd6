"""Hydra sweeps as users run them (`python train.py -m ...`): one run per job named from its overrides, the data
and features made once and read by every job, a table at the end, Optuna and submitit from the ecosystem, and a
killed job resumed alone by the same command."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
LRS = ("train.lr=0.001", "train.lr=0.0005")
NAMES = ("smoke-train.lr@0.001", "smoke-train.lr@0.0005")


def sweep(root: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", "-m", "+exp=smoke", f"run_root={root}", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=ENV)


def table(root: Path) -> list[dict]:
    return json.loads((root / "sweeps" / "smoke" / "sweep.json").read_text())


def test_a_two_job_sweep_prepares_and_captures_once_and_writes_its_table(tmp_path):
    proc = sweep(tmp_path, "train.lr=1e-3,5e-4")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.count("prepare: reusing") == 1 and proc.stdout.count("capture: reusing") == 1
    for name in NAMES:
        assert (tmp_path / name / "ckpt" / "final" / "head.safetensors").exists()
        assert json.loads((tmp_path / name / "inputs.json").read_text()) == json.loads(
            (tmp_path / NAMES[0] / "inputs.json").read_text())  # the same store entries
    head = f"{tmp_path / NAMES[0]}/ckpt/final"  # a job's run passes as a plain value in a later override
    assert OverridesParser.create().parse_override(f"head={head}").value() == head
    rows = table(tmp_path)
    assert [r["overrides"] for r in rows] == [[lr] for lr in LRS]
    assert sum(r["best"] for r in rows) == 1 and all(r["tau"] > 1 and len(r["tau_ci"]) == 2 for r in rows)
    made = rows[0]["seconds"]["prepare"] + rows[0]["seconds"]["capture"]
    assert rows[1]["seconds"]["prepare"] + rows[1]["seconds"]["capture"] < 0.1 * made
    assert "| 0 | `train.lr=0.001` |" in (tmp_path / "sweeps" / "smoke" / "sweep.md").read_text()


def test_an_optuna_sweep_maximises_the_dev_tau_the_jobs_return(tmp_path):
    proc = sweep(tmp_path, "+sweep=optuna", "hydra.sweeper.n_trials=2")
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = table(tmp_path)
    assert len(rows) == 2 and all({o.split("=")[0] for o in r["overrides"]} ==
                                  {"train.lr", "train.ttt_steps", "train.step_weight"} for r in rows)
    assert "Best value:" in proc.stdout or "best_value" in (tmp_path / "sweeps" / "smoke" / "optimization_results.yaml").read_text()


def test_a_submitit_local_job_runs_in_a_process_of_its_own(tmp_path):
    proc = sweep(tmp_path, "+sweep=local", "train.lr=1e-3")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert list((tmp_path / "sweeps" / "smoke" / ".submitit").glob("*/*_log.out"))
    assert table(tmp_path)[0]["tau"] > 1


def test_a_job_killed_mid_train_is_resumed_alone_by_the_same_command(tmp_path):
    args = ["train.lr=1e-3,5e-4", "train.ckpt_every=4", "train.max_steps=12"]
    killed = subprocess.run([sys.executable, "tests/sweep_fault.py", NAMES[1].removeprefix("smoke-"), "-m", "+exp=smoke",
                             f"run_root={tmp_path}", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-4000:]
    first, second = (tmp_path / f"smoke-train.ckpt_every@4+{lr.replace('=', '@')}+train.max_steps@12" for lr in LRS)
    assert (first / "summary.json").exists()  # job 0 had finished
    assert [p.name for p in (second / "ckpt").glob("step-*")] == ["step-0000004"]
    assert not (second / "ckpt" / "final").exists()
    proc = sweep(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"{first / 'eval' / 'report.json'} already holds this evaluation" in proc.stdout  # job 0: nothing redone
    assert f"resumed from {second / 'ckpt' / 'step-0000004'}" in proc.stdout
    rows = table(tmp_path)
    assert [r["status"] for r in rows] == ["COMPLETED", "COMPLETED"] and all(r["tau"] > 1 for r in rows)
