"""`python train.py +exp=smoke`: every stage end to end on a tiny random target, checked against the contracts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_evaluate import REPORT_KEYS, assert_rounds_commit_the_outputs, report_rows

ROOT = Path(__file__).resolve().parents[1]


def test_run_directory_and_report_contract(smoke_run):
    run_dir, proc, seconds = smoke_run
    for sub in ("ckpt", "eval", "export"):
        assert (run_dir / sub).is_dir(), sub
    inputs = json.loads((run_dir / "inputs.json").read_text())  # the store entries the run read
    assert (run_dir.parent / inputs["data"] / "summary.json").exists()
    assert (run_dir.parent / inputs["features"] / "manifest.json").exists()
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert REPORT_KEYS <= report.keys()
    assert report["lossless_mismatches"] == 0 and len(report["accept_per_depth"]) == report["tree"]["depth"]
    rows = report_rows(run_dir / "eval")
    assert len(rows) == report["num_prompts"] == 2
    assert_rounds_commit_the_outputs(report, rows)
    assert all({"prompt", "prompt_ids", "output_ids"} <= r.keys() and r["output_ids"] for r in rows)
    assert (run_dir / "eval" / "acceptance.png").stat().st_size > 0


def test_summary_names_tau_speedup_and_paths(smoke_run):
    run_dir, proc, _ = smoke_run
    assert "tau" in proc.stdout and "speedup" in proc.stdout
    assert str(run_dir / "eval" / "report.json") in proc.stdout
    assert "export sglang" in proc.stdout


def test_export_and_checkpoint_are_safetensors(smoke_run):
    run_dir, _, _ = smoke_run
    sglang = run_dir / "export" / "sglang"
    assert (sglang / "config.json").exists() and list(sglang.glob("*.safetensors"))
    assert (run_dir / "ckpt" / "final" / "head.safetensors").exists()
    assert (run_dir / "train" / "curves.png").exists()


def test_the_speculators_export_names_the_chain_the_evaluation_advises(smoke_run):
    run_dir, _, _ = smoke_run
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["split"] == "dev"
    advised = report["serving_advice"]["per_batch"][0]["vllm_steps"]
    config = json.loads((run_dir / "export" / "speculators" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == (advised or 3)


def test_wandb_logs_offline_and_no_secret_is_written(smoke_run):
    run_dir, proc, _ = smoke_run
    assert list((run_dir / "wandb").glob("offline-run-*"))
    tables = list((run_dir / "eval" / "wandb").glob("offline-run-*/files/media/table/eval/acceptance_*.table.json"))
    assert len(tables) == 1, tables
    table = json.loads(tables[0].read_text())
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    row = dict(zip(table["columns"], table["data"][0]))
    assert row["drafter"] == "head tree" and row["tau"] == pytest.approx(report["tau"])
    assert row["accept_per_depth_conditional_copy"] == str(
        [round(a, 3) for a in report["accept_per_depth_conditional_copy"]])
    assert "secret-key-never-written" not in (run_dir / "config.json").read_text()
    assert "secret-key-never-written" not in proc.stdout + proc.stderr


def test_rerun_resumes_every_stage_without_redoing_work(smoke_run):
    run_dir, _, first_seconds = smoke_run
    before = (run_dir / "ckpt" / "final" / "head.safetensors").read_bytes()
    proc = subprocess.run([sys.executable, "train.py", "+exp=smoke", f"run_root={run_dir.parent}",
                           "stages=[prepare,capture,train]"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_dir / "ckpt" / "final" / "head.safetensors").read_bytes() == before


def test_results_table_is_read_from_the_report(smoke_run, tmp_path):
    """The README's headline rows come from scripts/results_table.py; a report without lookup is refused."""
    run_dir, _, _ = smoke_run
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    table = subprocess.run([sys.executable, "scripts/results_table.py", str(run_dir / "eval")], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    lookup = report["baselines"]["prompt_lookup"]
    assert table.stdout.splitlines()[-1].startswith(
        f"| `smoke` | dev, 2 | {report['tau']:.2f} [{report['tau_ci'][0]:.2f}, {report['tau_ci'][1]:.2f}] | "
        f"{lookup['tau']:.2f} ")
    del report["baselines"]["prompt_lookup"]
    (tmp_path / "report.json").write_text(json.dumps(report))
    refused = subprocess.run([sys.executable, "scripts/results_table.py", str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "no `prompt_lookup` baseline" in refused.stderr
