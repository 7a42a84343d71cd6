"""Two ranks on CPU (`accelerate launch`, gloo) write disjoint shards and one manifest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from test_capture_store import LENGTHS, TINY, make_samples, small_cfg

from specdistill.capture import run as capture_run
from specdistill.capture.store import FeatureStore
from specdistill.layout import RunLayout
from specdistill.pipeline import LazyTarget

REPO = Path(__file__).resolve().parents[1]


def test_two_process_capture_matches_one_process(tmp_path):
    cfg = small_cfg(tmp_path, name="two")
    make_samples(cfg, LENGTHS)
    overrides = [
        f"run_root={cfg.run_root}",
        "name=two",
        "stages=[capture]",
        "target=random",
        f"target.random.hidden_size={TINY.hidden_size}",
        f"target.random.intermediate_size={TINY.intermediate_size}",
        f"target.random.num_hidden_layers={TINY.num_hidden_layers}",
        f"target.random.num_attention_heads={TINY.num_attention_heads}",
        f"target.random.num_key_value_heads={TINY.num_key_value_heads}",
        f"capture.shard_tokens={cfg.capture.shard_tokens}",
        f"capture.batch_tokens={cfg.capture.batch_tokens}",
    ]
    # `--cpu` in accelerate 1.x starts one process; `--multi_gpu` with no visible GPU: a gloo group on CPU
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(REPO / "commands" / "capture.py"),
            *overrides,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = RunLayout.of(cfg, "capture").features_dir
    store = FeatureStore(out)
    store.verify()
    assert list(out.glob("manifest*")) == [out / "manifest.json"]
    assert {s["rank"] for s in store.shards} == {0, 1}
    assert all(s["rank"] == k % 2 for k, s in enumerate(store.shards))
    held = [i for s in store.shards for i in s["sample_indices"]]
    assert sorted(held) == list(range(len(LENGTHS)))  # disjoint and complete

    one_cfg = small_cfg(tmp_path, name="one")
    make_samples(one_cfg, LENGTHS)
    single = FeatureStore(capture_run.run(one_cfg, RunLayout.of(one_cfg, "capture"),
                                          LazyTarget(one_cfg.target))["features"])
    assert single.source_indices == store.source_indices
    for i in range(len(store)):
        a, b = store.sample(i), single.sample(i)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["aux"].float(), b["aux"].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(a["last"].float(), b["last"].float(), rtol=1e-2, atol=1e-2)
