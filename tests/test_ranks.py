"""The whole pipeline under `accelerate launch --multi_gpu --num_processes 2` on CPU, as users run it: one job
whose ranks share the evaluation, write each artifact once, resume, and fail together."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import ENV, ROOT, compose_cfg

from specdistill.evaluate.bench import held_out_prompts
from specdistill.evaluate.run import PARTIAL, evaluate_head_tau
from specdistill.heads.checkpoint import load_head
from specdistill.target import load_target

pytestmark = pytest.mark.slow  # each launch starts two ranks that import DeepSpeed: ~15-40 s
SMOKE = ["+exp=smoke", "train.deepspeed=zero2", "eval.limit=4", "train.eval_every=3", "eval.loop_limit=2"]
# what a rerun or another world size measures anew: wall times and the ranks' shares
TIMES = {"wall_s", "baseline_wall_s", "speedup", "draft_s", "verify_s"}
SHARING = {"world", "prompts_per_rank", "resumed_batches"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def summaries(proc: subprocess.CompletedProcess) -> int:
    return proc.stdout.count("specdistill run `two` done")


def measured(report_dir: Path) -> dict:
    """A report without what another sitting measures anew (wall times, who decoded what), and its outputs."""
    report = json.loads((report_dir / "report.json").read_text())
    report = {k: v for k, v in report.items() if k not in TIMES | SHARING}
    report["baselines"] = {name: {k: v for k, v in b.items() if k not in TIMES}
                           for name, b in report["baselines"].items()}
    return {"report": report, "outputs": (report_dir / "outputs.jsonl").read_text()}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    proc = launch("train.py", *SMOKE, f"run_root={root}", "name=two")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "two", proc


def test_two_ranks_share_the_evaluation_and_print_one_summary(two_rank_run):
    run_dir, proc = two_rank_run
    assert summaries(proc) == 1
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["world"] == 2 and report["prompts_per_rank"] == [2, 2] and report["num_prompts"] == 4
    assert not (run_dir / "eval" / PARTIAL).exists()
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["sglang", "vllm"]


def test_a_resumed_two_rank_run_and_a_one_process_evaluation_give_the_same_report(two_rank_run, tmp_path):
    run_dir, _ = two_rank_run
    fresh = measured(run_dir / "eval")
    resumed = launch("train.py", *SMOKE, f"run_root={run_dir.parent}", "name=two")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert summaries(resumed) == 1 and measured(run_dir / "eval") == fresh
    one = subprocess.run([sys.executable, "train.py", *SMOKE, f"run_root={run_dir.parent}", "name=two",
                          "stages=[evaluate]", f"out={tmp_path / 'one'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=400, env=ENV)
    assert one.returncode == 0, one.stderr[-4000:]
    assert measured(tmp_path / "one") == fresh
    assert json.loads((tmp_path / "one" / "report.json").read_text())["prompts_per_rank"] == [4]


def test_the_in_loop_tau_of_two_ranks_is_a_one_process_evaluation(two_rank_run):
    """The last in-loop evaluation scored the final head, its prompts shared by the two ranks."""
    run_dir, _ = two_rank_run
    cfg = compose_cfg(run_dir, *SMOKE[1:])
    history = json.loads((run_dir / "train" / "history.json").read_text())
    prompts = held_out_prompts(cfg.eval.bench, cfg.eval.limit, cfg.eval.loop_limit)
    alone = evaluate_head_tau(load_head(run_dir / "ckpt" / "final"), load_target(cfg.target), prompts, cfg.eval)
    assert history[-1]["tau"] == alone["tau"]


def test_a_rank_killed_during_evaluate_resumes_its_share(two_rank_run, tmp_path):
    run_dir, _ = two_rank_run
    out = tmp_path / "eval"
    args = [*SMOKE, f"run_root={run_dir.parent}", "name=two", "stages=[evaluate]", f"out={out}"]
    killed = launch("tests/rank_faults.py", "kill", "1", *args)
    assert killed.returncode != 0 and not (out / "report.json").exists()
    assert list((out / PARTIAL).glob("batches.rank*.jsonl"))
    rerun = launch("train.py", *args)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert json.loads((out / "report.json").read_text())["resumed_batches"] >= 1
    assert measured(out) == measured(run_dir / "eval")


@pytest.mark.parametrize(("fault", "victim", "stage", "waiting"), [("raise", 1, "evaluate", 0),
                                                                    ("export", 0, "export", 1)])
def test_a_failing_rank_ends_every_rank_with_its_error_named(two_rank_run, tmp_path, fault, victim, stage, waiting):
    """Rank 1 fails while rank 0 decodes; rank 0 fails in the export while rank 1 waits for it."""
    run_dir, _ = two_rank_run
    proc = launch("tests/rank_faults.py", fault, str(victim), *SMOKE, f"run_root={run_dir.parent}", "name=two",
                  f"stages=[{stage}]", f"out={tmp_path / stage}", timeout=300)
    assert proc.returncode != 0
    logs = proc.stdout + proc.stderr
    assert f"rank {waiting} of 2 stops: rank {victim} failed first: FileNotFoundError: injected fault on rank {victim}" in logs
    assert summaries(proc) == 0
