"""`python benchmarks/anchor.py <run>` as a user runs it: vLLM's `speculators` trainer on a finished run's features,
its head served by vLLM beside ours. On the tiny random target (+exp=smoke) the taus mean nothing; what is checked
is that the path runs, that speculators' head loads and is served losslessly, and that the hidden states it trains
on sit at the layers it is told."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdistill.anchor import (
    AnchorError,
    check_layer_ids,
    interop_dir,
    speculators_layer_ids,
    train_speculators,
    write_inputs,
)
from specdistill.capture.store import FeatureStore
from specdistill.config import run_config_of
from specdistill.data.vocab import DraftVocab
from specdistill.io import write_json
from specdistill.layout import RunLayout
from specdistill.target import load_target
from specdistill.train.data import holdout_split

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def interop_ready():
    """Skip where speculators (`make anchor`) is not installed; under make test SLOW=1, which installs it, fail."""
    try:
        return interop_dir()
    except AnchorError as err:
        if os.environ.get("SPECDISTILL_ENGINE") == "1":
            pytest.fail(f"make test SLOW=1 installs speculators, yet: {err}")
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def smoke_inputs(smoke_run, tmp_path_factory):
    """speculators' inputs written from the smoke run's features, and the run's target."""
    cfg = run_config_of(smoke_run[0])
    layout = RunLayout.of(cfg)
    store = FeatureStore(layout.features_dir)
    out = tmp_path_factory.mktemp("anchor") / "inputs"
    written = write_inputs(store, *holdout_split(len(store), cfg.train.holdout_share, cfg.seed),
                           DraftVocab.load(layout.vocab_file), out)
    return out, written, load_target(cfg.target), store


def test_the_inputs_hold_our_rows_in_order_and_our_states_at_the_ids_speculators_reads(smoke_inputs):
    from datasets import load_from_disk

    out, written, target, store = smoke_inputs
    rows = load_from_disk(str(out))
    assert len(rows) == written["rows"] == len(store) and written["tokens"] == store.num_tokens
    assert set(rows.column_names) >= {"input_ids", "loss_mask", "seq_len"}
    check_layer_ids(target.model, out, speculators_layer_ids(target.layer_ids))


@pytest.mark.parametrize("shift", [-1, 1])
def test_layer_ids_off_by_one_are_refused(smoke_inputs, shift):
    out, _, target, _ = smoke_inputs
    with pytest.raises(AnchorError, match="layer ids are off"):
        check_layer_ids(target.model, out, [k + shift for k in speculators_layer_ids(target.layer_ids)])


def test_a_finished_speculators_run_is_reused_only_for_the_same_arguments(interop_ready, tmp_path):
    save = tmp_path / "speculators"
    save.mkdir()
    write_json(save / "result.json", {"checkpoint": "kept", "steps": [], "arguments": ["--no-such-flag"]})
    assert train_speculators(["--no-such-flag"], save)["checkpoint"] == "kept"
    with pytest.raises(AnchorError, match=r"exited with code 2; its log is .*train\.log"):  # its own usage error
        train_speculators(["--no-such-flag", "--nor-this"], save)
    assert not (save / "result.json").exists()


@pytest.mark.slow
def test_speculators_trains_on_the_run_and_vllm_serves_its_head_beside_ours(smoke_run, interop_ready, engine_ready):
    run_dir = smoke_run[0]
    proc = subprocess.run([sys.executable, "benchmarks/anchor.py", str(run_dir), "--prompts", "2",
                           "--max-new-tokens", "16", "--timing-steps", "3", "--dtype", "float32"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ours / speculators" in proc.stdout and str(run_dir / "anchor" / "anchor.json") in proc.stdout
    report = json.loads((run_dir / "anchor" / "anchor.json").read_text())
    assert report["speculators_trained"]["steps"] == report["ours_trained"]["steps"]
    theirs = json.loads((Path(report["heads"]["speculators"]["dir"]) / "config.json").read_text())
    ours = json.loads((run_dir / "anchor" / "ours" / "config.json").read_text())
    assert theirs["speculators_model_type"] == "eagle3"
    assert theirs["eagle_aux_hidden_state_layer_ids"] == ours["eagle_aux_hidden_state_layer_ids"]
    assert theirs["draft_vocab_size"] == report["inputs"]["draft_vocab_size"]
    for head in report["heads"].values():  # loaded whole, drafting, and lossless in float32
        assert head["drafts"] > 0 and head["weight_warnings"] == [] and head["outputs_equal_plain"] == 2
    assert report["timing"]["ours"]["s_per_step"] > 0 and report["timing"]["speculators"]["s_per_step"] > 0
