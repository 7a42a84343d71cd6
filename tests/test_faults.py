"""Fault injection: a run directory that knows what it holds. Each test breaks one thing (a changed config over
kept work, a flipped byte, a truncated checkpoint, a head for another target, a bad benchmark file) and asserts
the exact outcome: refused with the file or field named and exit code 2, or passed over with a warning."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from specdistill.config import HeadConfig, RandomTargetConfig, TargetConfig, register, to_run_config
from specdistill.data.vocab import build_draft_vocab
from specdistill.evaluate.bench import BenchError, load_items
from specdistill.evaluate.run import load_any_head
from specdistill.export import export_eagle3
from specdistill.fingerprint import TRAINED_ON, StaleRun, check_head_is_current
from specdistill.heads.build import build_head
from specdistill.heads.checkpoint import HeadMismatch, check_head_fits_target, load_head, save_head
from specdistill.io import CorruptFile, JsonlError, write_checksums
from specdistill.layout import RunLayout, trained_head_dir
from specdistill.target import load_target

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
SECRETS = ("pw-SECRET-1", "sk-SECRET-2")
SERVER_URL = f'data.generation.server_url="https://alice:{SECRETS[0]}@llm.example/v1?api-key={SECRETS[1]}"'


def train_py(root: Path, *args: str) -> subprocess.CompletedProcess:
    """The run's log and errors together in `stdout` (Hydra logs to stdout)."""
    return subprocess.run([sys.executable, "train.py", "+exp=smoke", f"run_root={root}", SERVER_URL, *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=ENV)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, str]:
    """A smoke run through training (prepare, capture, train) with W&B writing offline, and its log: ~15 s."""
    root = tmp_path_factory.mktemp("runs")
    proc = train_py(root, "stages=[prepare,capture,train]", "wandb.mode=offline")
    assert proc.returncode == 0, proc.stdout[-3000:]
    return root / "smoke", proc.stdout


def test_a_key_in_the_server_url_is_in_no_file_and_no_log(trained):
    run_dir, log = trained
    assert list((run_dir / "wandb").glob("offline-run-*"))
    for path in [p for p in run_dir.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert not any(secret.encode() in data for secret in SECRETS), path
    assert not any(secret in log for secret in SECRETS)
    assert "https://***@llm.example/v1?api-key=***" in (run_dir / "config.json").read_text()


def copy_run(trained: tuple[Path, str], tmp_path: Path) -> Path:
    """The trained run and the store it read, under `tmp_path`."""
    shutil.copytree(trained[0].parent, tmp_path, ignore=shutil.ignore_patterns("wandb"), dirs_exist_ok=True)
    return tmp_path / "smoke"


def compose_cfg(*overrides: str):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_run_config(compose(config_name="config", overrides=["+exp=smoke", *overrides]))


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "ckpt").glob("step-*"))


def flip_byte(path: Path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_changed_data_never_resumes_the_old_runs_checkpoint(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    old_head = (run_dir / "ckpt" / "final" / "head.safetensors").read_bytes()
    proc = train_py(tmp_path, "stages=[prepare,capture,train]", "data.synth.num_conversations=12")
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
    assert f"{checkpoints(run_dir)[-1]} was made from other inputs or settings" in proc.stdout
    assert "input:features" in proc.stdout and "input:draft_vocab" in proc.stdout
    assert "name=<another name than smoke>" in proc.stdout and "restart=true" in proc.stdout
    cfg = compose_cfg(f"run_root={tmp_path}", "data.synth.num_conversations=12")
    for head_dir in ("final", "best"):  # evaluate and export alone must not take the old heads either
        with pytest.raises(StaleRun, match=r"input:data_key: .*input:draft_vocab: .*input:features: "):
            check_head_is_current(run_dir / "ckpt" / head_dir, cfg, RunLayout.of(cfg))
    proc = train_py(tmp_path, "stages=[train]", "train.lr=0.002")  # a setting alone is named with both values
    assert proc.returncode == 2 and "train.lr: 0.001 -> 0.002" in proc.stdout
    proc = train_py(tmp_path, "stages=[train]", "data.synth.num_conversations=12", "restart=true")  # data made above
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (run_dir / "ckpt" / "final" / "head.safetensors").read_bytes() != old_head


def test_a_kept_head_is_checked_against_what_is_still_there(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    final = run_dir / "ckpt" / "final"
    cfg = compose_cfg(f"run_root={tmp_path}")
    check_head_is_current(final, cfg, RunLayout.of(cfg))
    shutil.rmtree(RunLayout.of(cfg).features_dir)  # deleted after training to free the disk: evaluation still runs
    check_head_is_current(final, cfg, RunLayout.of(cfg))
    other = compose_cfg(f"run_root={tmp_path}", "train.lr=0.002")
    with pytest.raises(StaleRun, match=r"final was made from other inputs .*\(train.lr: 0.001 -> 0.002\)"):
        check_head_is_current(final, other, RunLayout.of(other))
    recorded = json.loads((final / TRAINED_ON).read_text())
    (final / TRAINED_ON).write_text(json.dumps({k: v for k, v in recorded.items() if k != "head.fc_norm"}))
    check_head_is_current(final, cfg, RunLayout.of(cfg))  # trained before the field existed: as its default
    eagle31 = compose_cfg(f"run_root={tmp_path}", "head.fc_norm=true")
    with pytest.raises(StaleRun, match=r"\(head.fc_norm: False -> True\)"):
        check_head_is_current(final, eagle31, RunLayout.of(eagle31))


def test_a_flipped_feature_byte_is_refused_by_training_and_recaptured_by_capture(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    shutil.rmtree(run_dir / "ckpt")
    shard = RunLayout.of(compose_cfg(f"run_root={tmp_path}")).features_dir / "shard-00000.safetensors"
    intact = shard.read_bytes()
    flip_byte(shard)
    proc = train_py(tmp_path, "stages=[train]")
    assert proc.returncode == 2 and "Traceback" not in proc.stdout
    assert "shard-00000.safetensors: sha256" in proc.stdout and "stages=[capture]" in proc.stdout
    proc = train_py(tmp_path, "stages=[capture]")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "shard-00000.safetensors: sha256" in proc.stdout  # the warning names the shard it recaptures
    assert shard.read_bytes() == intact  # capture is deterministic: the shard is whole again


def test_a_truncated_checkpoint_falls_back_to_the_one_before(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    want = load_file(str(run_dir / "ckpt" / "final" / "head.safetensors"))
    shutil.rmtree(run_dir / "ckpt" / "final")
    before, newest = checkpoints(run_dir)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    proc = train_py(tmp_path, "stages=[train]")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"{weights}: sha256" in proc.stdout and f"resumed from {before}" in proc.stdout
    got = load_file(str(run_dir / "ckpt" / "final" / "head.safetensors"))
    assert all(got[k].equal(want[k]) for k in want)  # retrained from the one before: the same head, bit for bit
    (newest / "checksums.json").unlink()  # never finished: passed over for the one before, named
    proc = train_py(tmp_path, "stages=[train]")
    assert proc.returncode == 0 and f"{newest}: no checksums.json" in proc.stdout and f"resumed from {before}" in proc.stdout
    for ckpt in checkpoints(run_dir):
        flip_byte(ckpt / "trainer_state.json", 5)
    proc = train_py(tmp_path, "stages=[train]")
    assert proc.returncode == 2 and "every checkpoint in" in proc.stdout and "Traceback" not in proc.stdout


def test_training_records_survive_a_resume_and_a_rerun(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    samples = run_dir / "train" / "samples-rank-0.json"
    full = json.loads(samples.read_text())["micro_batches"]
    before, newest = checkpoints(run_dir)
    assert len(full) == json.loads((newest / "trainer_state.json").read_text())["micro"]
    shutil.rmtree(newest)  # as if killed after the checkpoint before
    proc = train_py(tmp_path, "stages=[train]")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert json.loads(samples.read_text())["micro_batches"] == full
    proc = train_py(tmp_path, "stages=[train]")  # a finished run, run again
    assert proc.returncode == 0 and json.loads(samples.read_text())["micro_batches"] == full


def test_a_corrupted_head_is_passed_over_then_refused_by_name(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    best, final = run_dir / "ckpt" / "best", run_dir / "ckpt" / "final"
    flip_byte(best / "head.safetensors")
    assert trained_head_dir(run_dir / "ckpt") == final  # evaluate and export fall back to final/, with a warning
    with pytest.raises(CorruptFile, match="best/head.safetensors: sha256"):
        load_head(best)
    flip_byte(final / "head.safetensors")
    proc = train_py(tmp_path, "stages=[export]")
    assert proc.returncode == 2 and "Traceback" not in proc.stdout
    assert "no intact head checkpoint" in proc.stdout
    assert "best/head.safetensors: sha256" in proc.stdout and "final/head.safetensors: sha256" in proc.stdout
    (final / "checksums.json").unlink()  # never finished
    with pytest.raises(CorruptFile, match="final: no checksums.json"):
        load_head(final)
    (final / "head.safetensors").write_bytes((final / "head.safetensors").read_bytes()[:64])
    write_checksums(final)  # broken before its checksums were written: the load itself names the file
    with pytest.raises(CorruptFile, match="final/head.safetensors: unreadable"):
        load_head(final)
    flip_byte(final / "head_config.json", 2)
    write_checksums(final)
    with pytest.raises(CorruptFile, match="final/head_config.json: not a head config"):
        load_head(final)


@pytest.fixture(scope="module")
def smoke_head():
    target = load_target(TargetConfig(name="random", random=RandomTargetConfig(num_hidden_layers=6),
                                      capture_layers=[1, 2, 3]))
    vocab = build_draft_vocab(target.model.get_output_embeddings().weight.abs().sum(1).long(), 128)
    return build_head(HeadConfig(), target, vocab.d2t_N, vocab.t2d_V), target


@pytest.mark.parametrize("other, named", [
    (dict(capture_layers=[1, 2, 4]), "capture layers: the head's [1, 2, 3], the target's [1, 2, 4]"),
    (dict(random=RandomTargetConfig(num_hidden_layers=6, vocab_size=400)), "vocabulary: the head's 384, the target's 400"),
    (dict(random=RandomTargetConfig(num_hidden_layers=6, hidden_size=32)), "hidden size: the head's 64, the target's 32"),
    (dict(random=RandomTargetConfig(num_hidden_layers=6, seed=1)), "input embedding fingerprint: the head's "),
])
def test_a_head_for_another_target_is_refused_naming_both_sides(smoke_head, tmp_path, other, named):
    head, target = smoke_head
    save_head(head, tmp_path / "head")
    check_head_fits_target(load_head(tmp_path / "head"), target, tmp_path / "head")  # its own target: fine
    spec = {"name": "random", "random": RandomTargetConfig(num_hidden_layers=6), "capture_layers": [1, 2, 3], **other}
    with pytest.raises(HeadMismatch, match=r"trained for target `random`, which does not fit target `random`") as err:
        check_head_fits_target(load_head(tmp_path / "head"), load_target(TargetConfig(**spec)), tmp_path / "head")
    assert named in str(err.value) and str(tmp_path / "head") in str(err.value)


def test_the_evaluation_scripts_refuse_a_head_or_export_for_another_target(smoke_head, tmp_path):
    head, _ = smoke_head
    save_head(head, tmp_path / "head")
    export_eagle3(head, "vllm", tmp_path / "export", "float32")
    other = load_target(TargetConfig(name="random", random=RandomTargetConfig(num_hidden_layers=6),
                                     capture_layers=[1, 2, 4]))
    for path in (tmp_path / "head", tmp_path / "export"):  # commands/evaluate.py and commands/engine.py load through it
        with pytest.raises(HeadMismatch, match="capture layers: the head's \\[1, 2, 3\\], the target's \\[1, 2, 4\\]"):
            load_any_head(path, other)


def test_the_pipeline_evaluates_no_head_trained_for_another_target(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    proc = train_py(tmp_path, "stages=[evaluate]", "target.random.seed=1")  # same shapes, other weights
    assert proc.returncode == 2 and "Traceback" not in proc.stdout
    assert "input embedding fingerprint: the head's" in proc.stdout and str(run_dir / "ckpt" / "best") in proc.stdout
    assert not (run_dir / "eval").exists()  # refused before any decoding


def test_a_malformed_or_empty_bench_file_is_named_with_its_line(tmp_path):
    bad = tmp_path / "bench.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": ["cut\n')
    with pytest.raises(JsonlError, match=r"bench.jsonl, line 2: not a UTF-8 JSON line"):
        load_items(str(bad))
    bad.write_bytes(b'{"turns": ["caf\xe9"]}\n')
    with pytest.raises(JsonlError, match=r"bench.jsonl, line 1"):
        load_items(str(bad))
    bad.write_text("\n")
    with pytest.raises(BenchError, match=r"bench.jsonl: the file holds no rows"):
        load_items(str(bad))
    bad.write_bytes(b'\xef\xbb\xbf{"turns": ["first row kept"]}\n')
    assert load_items(str(bad)) == [["first row kept"]]
