"""The real embedded target (SmolLM2-135M-Instruct) through every stage, on a handful of conversations."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_evaluate import assert_rounds_commit_the_outputs, report_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_stage_on_the_embedded_target(tmp_path):
    overrides = [
        f"run_root={tmp_path}", "name=slow", "wandb.mode=disabled",
        "data.synth.num_conversations=8", "data.synth.batch_size=8", "data.synth.answer_max_tokens=48",
        "data.documents.min_chars=100",
        "data.draft_vocab_size=2048", "train.max_steps=4", "train.ttt_steps=3", "train.batch_tokens=1024",
        "eval.limit=2", "eval.max_new_tokens=24", "eval.tree.depth=3", "eval.tree.topk=4", "eval.tree.num_draft_tokens=12",
    ]
    proc = subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "slow"
    manifest = json.loads(next((run_dir.parent / "store" / "features").glob("*/manifest.json")).read_text())
    assert manifest["layer_ids"] == [1, 14, 26] and manifest["hidden_size"] == 576
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["num_prompts"] == 2 and report["lossless_mismatches"] == 0
    assert_rounds_commit_the_outputs(report, report_rows(run_dir / "eval"))
    config = json.loads((run_dir / "export" / "sglang" / "config.json").read_text())
    # the exported head is the served one: its 2,048 trained draft tokens widened to train.served_vocab_size
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 32768
