"""A real engine (vLLM's CPU build, in `.engine/`) serves our exports: it loads them whole, its outputs equal its own
plain greedy decoding, and in float32 it counts, position by position, exactly what our chain drafter counts on the
same prompts. Exports with a deliberate fault must break that agreement, so the check is shown able to fail.

The engine tests are slow (`make test SLOW=1` installs the engine first and sets SPECDISTILL_ENGINE=1, which turns
a missing engine into a failure); the tests of the comparison itself run everywhere.
"""

import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdistill.config import EngineConfig, EvalConfig, RandomTargetConfig, TargetConfig
from specdistill.evaluate import engine
from specdistill.evaluate.bench import load_items
from specdistill.evaluate.counters import COUNTED, chain_counters
from specdistill.evaluate.engine import compare, engine_evaluation, our_chain, served_exports
from specdistill.evaluate.forced import bf16_spread, replay_bound
from specdistill.evaluate.report import engine_markdown
from specdistill.export import common, export_dflash, export_eagle3
from specdistill.export.reader import read_head
from specdistill.heads.checkpoint import head_from_state, load_head
from specdistill.layout import trained_head_dir
from specdistill.target import load_target, served_dir
from specdistill.target_runner import TargetRunner

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


# --- the comparison, without an engine ------------------------------------------------------------------


def test_chain_counters_are_the_engines_counters():
    # rounds accepting 0, 3, 1 and 2 of 3 drafts: 4 drafts, 6 tokens, position p reached by rounds accepting > p
    assert chain_counters([0, 3, 1, 2], 3) == {"drafts": 4, "accepted": 6, "accepted_per_pos": [3, 2, 1]}
    assert engine.tau_of(chain_counters([0, 3, 1, 2], 3)) == 2.5


def counted(rounds_per_prompt: list[list[int]], k: int = 3) -> dict:
    """Counters in all and per prompt, from each prompt's accepted drafts per round."""
    return {**chain_counters([a for rounds in rounds_per_prompt for a in rounds], k),
            "per_prompt": [chain_counters(rounds, k) for rounds in rounds_per_prompt]}


def served(outputs, counts, warnings=()):
    return {"outputs": outputs, "counters": {key: counts[key] for key in COUNTED}, "per_prompt": counts["per_prompt"],
            "wall_s": 2.0, "load_s": 1.0, "weight_warnings": list(warnings)}


def explained_as(near_tie: bool):
    """An explanation as `near_ties.explain` gives one (the replay itself is tested below, on a real model)."""
    return lambda i, counters: ({"near_tie": True, "round": 4, "position": 1, "margin": 1e-6} if near_tie else
                                {"near_tie": False, "smallest_margin": 0.5, "flips_tried": 0})


def test_float32_compares_prompt_by_prompt_and_only_a_replayed_near_tie_excuses_a_difference():
    outputs = [[1, 2], [3, 4]]
    ours = counted([[0, 3, 1, 2] * 12, [0, 3, 1, 2] * 13])  # 100 drafts, 150 accepted: tau 2.5
    plain = served(outputs, counted([[], []]))
    same = compare(ours, served(outputs, ours), plain, outputs, "float32", explained_as(False), 1e-5)
    assert same["counters_equal_ours"] and same["prompts_equal_ours"] == 2 and same["finding"] is None
    # one draft of prompt 1 accepted one token more in the engine
    moved = counted([[0, 3, 1, 2] * 12, [1, 3, 1, 2] + [0, 3, 1, 2] * 12])
    tie = compare(ours, served(outputs, moved), plain, outputs, "float32", explained_as(True), 1e-5)
    assert tie["differing_prompts"] == [1] and tie["prompts_equal_ours"] == 1 and tie["finding"] is None
    assert tie["near_ties"] == [{"prompt": 1, "near_tie": True, "round": 4, "position": 1, "margin": 1e-6}]
    assert "prompt 1 a near-tie (round 4, position 1: margin 1e-06 < epsilon 1e-05)" in engine.explained_differences(tie)
    misread = compare(ours, served(outputs, moved), plain, outputs, "float32", explained_as(False), 1e-5)
    assert "differ from ours in float32 on prompts [1]" in misread["finding"]
    assert "read differently from how it was trained" in misread["finding"]
    # two prompts whose differences cancel out in the totals: still a finding
    swapped = counted([[1, 3, 1, 2] + [0, 3, 1, 2] * 11, [0, 3, 0, 2] + [0, 3, 1, 2] * 12])
    swapped_total = compare(ours, served(outputs, swapped), plain, outputs, "float32", explained_as(False), 1e-5)
    assert swapped_total["counters_equal_ours"] and swapped_total["differing_prompts"] == [0, 1]
    assert "on prompts [0, 1]" in swapped_total["finding"]
    # the first prompt read differently makes the finding: the second is not replayed
    replayed = []
    def explain_counting(i, counters):
        replayed.append(i)
        return explained_as(False)(i, counters)
    first_only = compare(ours, served(outputs, swapped), plain, outputs, "float32", explain_counting, 1e-5)
    assert replayed == [0] and first_only["not_replayed"] == [1] and "on prompts [0, 1]" in first_only["finding"]
    # a near-tie does not stop the replays: every prompt must be one for no finding
    both = compare(ours, served(outputs, swapped), plain, outputs, "float32", explained_as(True), 1e-5)
    assert [t["prompt"] for t in both["near_ties"]] == [0, 1] and both["finding"] is None
    # a prompt the target decodes differently is set aside, the other still compared
    other = [[1, 2], [3, 5]]
    aside = compare(ours, served(other, moved), served(other, counted([[], []])), outputs, "float32",
                    explained_as(False), 1e-5)
    assert aside["set_aside"] == [1] and aside["differing_prompts"] == [] and aside["finding"] is None
    assert "prompts [1] set aside" in engine.explained_differences(aside)
    everything = compare(ours, served(other, moved), served(other, counted([[], []])), [[9], [9]], "float32",
                         explained_as(False), 1e-5)
    assert "no prompt's counts can be compared" in everything["finding"]


def test_speculative_outputs_unlike_the_engines_plain_ones_are_a_float32_finding_only():
    outputs = [[1, 2], [3, 4]]
    ours = counted([[0, 3, 1, 2] * 12, [0, 3, 1, 2] * 13])
    plain = served(outputs, counted([[], []]))
    lossy = compare(ours, served([[1, 2], [3, 5]], ours), plain, outputs, "float32", explained_as(False), 1e-5)
    assert lossy["counters_equal_ours"] and lossy["mismatched_prompts"] == [1] and lossy["outputs_equal_plain"] == 1
    assert "not lossless in the engine: 1 of 2" in lossy["finding"]
    assert compare(ours, served([[1, 2], [3, 5]], ours), plain, outputs, "bfloat16", replayed=ours)["finding"] is None
    warned = compare(ours, served(outputs, ours, ["weights not found: fc.weight"]), plain, outputs, "float32")
    assert "did not load" in warned["finding"]


def test_bfloat16_holds_the_engine_tau_against_our_replay_along_its_outputs():
    outputs = [[1, 2], [3, 4]]
    ours = counted([[0, 3, 1, 2] * 12, [0, 3, 1, 2] * 13])  # 100 drafts, tau 2.5
    plain = served(outputs, counted([[], []]))
    # the yardstick is our chain along the engine's outputs, not our free decode (another text in bfloat16)
    free = counted([[0] * 50, [0] * 50])
    alike = compare(free, served(outputs, ours), plain, outputs, "bfloat16", replayed=ours)
    assert alike["finding"] is None and alike["tau_ratio_to_replay"] == 1.0 and alike["tau_ratio_to_ours"] == 2.5
    assert "1.000x our chain along the engine's outputs" in engine.explained_differences(alike)
    one_off = counted([[0, 3, 1, 2] * 12, [1, 3, 1, 2] + [0, 3, 1, 2] * 12])
    assert compare(ours, served(outputs, one_off), plain, outputs, "bfloat16", replayed=ours)["finding"] is None
    # tau 2.25 against 2.5 (a tenth lost) over 100 and over 10,000 drafts: flagged exactly when beyond the bound
    for scale in (25, 2500):
        base, fewer = counted([[0, 3, 1, 2] * scale, []]), counted([[0, 2, 1, 2] * scale, []])
        entry = compare(base, served(outputs, fewer), plain, outputs, "bfloat16", replayed=base)
        beyond = abs(entry["tau_ratio_to_replay"] - 1) > replay_bound(base["drafts"])[0]
        assert (entry["finding"] is not None) == beyond and (scale == 25 or beyond), entry["tau_ratio_to_replay"]
        assert not beyond or "beyond bfloat16 rounding" in entry["finding"]
    with pytest.raises(ValueError, match="pass `replayed`"):
        compare(ours, served(outputs, ours), plain, outputs, "bfloat16")


def test_the_root_cause_is_the_first_exception_line_of_the_log_tail():
    message = ("vllm (d2t, python) exited with code 1; its log is d2t.log, ending:\n  File \"x.py\", line 3\n"
               "ERROR [core.py:1] RuntimeError: Worker failed with error 'index 49152 is out of bounds'\n"
               "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
               "INFO [utils.py:628] [shutdown] Process manager: send sigterm to process EngineCore")
    cause = engine.root_cause(message)
    assert cause.startswith("ERROR [core.py:1] RuntimeError: Worker failed") and "its log is d2t.log" in cause
    assert engine.root_cause("vllm exited with code 1; ending:\nKilled").startswith("Killed")


def test_a_layout_the_engine_failed_on_is_reported_beside_the_others():
    ours = dict(counted([[0, 3, 1, 2]]), drafter="chain of 3", tau=2.5)
    ran = compare(ours, served([[1]], ours), served([[1]], counted([[]])), [[1]], "float32")
    report = {"engine": "vllm", "version": "0.32.0", "dtype": "float32", "num_speculative_tokens": 3,
              "num_prompts": 1, "ours": ours,
              "layouts": {"vllm": {"layout": "vllm", **ran},
                          "speculators": {"layout": "speculators", "failed": True,
                                          "finding": "vllm failed serving this export: RuntimeError: out of bounds"}}}
    digest = engine.engine_digest(report)
    assert "speculators FAILED" in digest["line"] and "vllm 2.500" in digest["line"]
    table = "\n".join(engine_markdown(digest))
    assert "| speculators | failed |" in table and "**vllm failed serving this export" in table
    assert "| vllm | 2.500 | 2.500 | 1.000x |" in table


def test_only_weight_problems_count_as_weight_warnings():
    flagged = ["Some weights of the model were not initialized: ['fc.weight']", "missing keys: ['norm.weight']",
               "unexpected key layers.0.x in checkpoint", "weights not found: fc.weight"]
    harmless = ["WARNING [core_client.py:817] [shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
                "The explicitly set RoPE scaling factor does not match the ratio implicitly set"]
    assert all(engine.WEIGHT_PROBLEM.search(line) for line in flagged)
    assert not any(engine.WEIGHT_PROBLEM.search(line) for line in harmless)


def test_a_speculators_export_is_served_with_the_local_target_as_verifier(tmp_path):
    target_dir = tmp_path / "target"
    export = tmp_path / "speculators"
    export.mkdir()
    (export / common.WEIGHTS_FILE).write_bytes(b"weights")
    config = {"speculators_model_type": "eagle3", "speculators_config": {"verifier": {"name_or_path": "org/model"}}}
    (export / common.CONFIG_FILE).write_text(json.dumps(config))
    (name, directory), = served_exports(export, target_dir, tmp_path / "out").items()
    assert name == "speculators" and directory != export
    assert json.loads((directory / common.CONFIG_FILE).read_text())["speculators_config"]["verifier"] == {
        "name_or_path": str(target_dir)}
    assert (directory / common.WEIGHTS_FILE).read_bytes() == b"weights"
    config["speculators_config"]["verifier"]["name_or_path"] = str(target_dir)
    (export / common.CONFIG_FILE).write_text(json.dumps(config))
    assert served_exports(export, target_dir, tmp_path / "out") == {"speculators": export}


# --- the real engine on the real embedded target --------------------------------------------------------

EVAL = ["eval.limit=4", "eval.max_new_tokens=48", "eval.tree.depth=3", "eval.tree.topk=4", "eval.tree.num_draft_tokens=12"]


def engine_prompts(path: Path, count: int) -> Path:
    """The first `count` Spec-Bench questions' first turns, as a jsonl the head learns from and the check serves."""
    path.write_text("".join(json.dumps({"turns": turns[:1]}) + "\n" for turns in load_items("spec_bench")[:count]))
    return path


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory, engine_ready):
    """The embedded target through every stage to evaluate, with a head that learnt the target's answers to the
    prompts served (`+exp=engine_check`, `<run_root>/prompts.jsonl`), and `eval.engine.name=vllm`."""
    root = tmp_path_factory.mktemp("runs")
    prompts = engine_prompts(root / "prompts.jsonl", 20)
    overrides = ["+exp=engine_check", f"run_root={root}", "name=engine", "stages=[prepare,capture,train,evaluate]",
                 f"data.path={prompts}", f"eval.bench={prompts}", "eval.engine.name=vllm", *EVAL]
    proc = subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=3000, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "engine", proc.stdout


@pytest.mark.slow
def test_vllm_serves_both_layouts_exactly_as_our_chain_counts(embedded_run):
    run_dir, stdout = embedded_run
    report = json.loads((run_dir / "eval" / "engine.json").read_text())
    assert report["engine"] == "vllm" and report["dtype"] == "float32" and report["num_speculative_tokens"] == 3
    ours, n = report["ours"], report["num_prompts"]
    assert n == 4 and report["plain"]["outputs_equal_ours"] == n  # the engine's greedy is ours, token for token
    assert ours["accepted"] > 0, "the head accepts nothing: the faults below could not change its counts"
    for layout in ("vllm", "speculators"):
        m = report["layouts"][layout]
        assert m["layout"] == layout and m["weight_warnings"] == []
        assert m["outputs_equal_plain"] == n and m["mismatched_prompts"] == []
        assert (m["drafts"], m["accepted"], m["accepted_per_pos"]) == (
            ours["drafts"], ours["accepted"], ours["accepted_per_pos"]), layout
        assert m["counters_equal_ours"] and m["prompts_equal_ours"] == n and m["finding"] is None, m["finding"]
    assert 0 <= report["epsilon"] < 1e-2  # two float32 kernels' largest disagreement on a top-2 margin
    digest = json.loads((run_dir / "eval" / "report.json").read_text())["engine"]
    assert digest["layouts"]["vllm"]["tau"] == report["layouts"]["vllm"]["tau"]
    assert "## In the engine: vllm" in (run_dir / "eval" / "summary.md").read_text()


def faulty(export: Path, out: Path, fault: str) -> Path:
    """A copy of a vLLM export with one fault an engine cannot see but drafts wrongly with."""
    shutil.copytree(export, out)
    config = json.loads((out / common.CONFIG_FILE).read_text())
    if fault == "layer_ids_off_by_one" and "dflash_config" in config:  # a DFlash export names them once
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    elif fault == "layer_ids_off_by_one":  # both conventions moved together, so the export stays self-consistent
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [
            i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    elif fault == "norm_flag_flipped":
        config["norm_before_residual"] = not config["norm_before_residual"]
    elif fault == "mask_token_wrong":  # a P-EAGLE export whose mask slots read another token than it was trained on
        config["mask_token_id"] = (config["mask_token_id"] + 1) % config["vocab_size"]
    elif fault == "fc_norm_dropped":  # an Eagle 3.1 export without its norms' weights: vLLM keeps them at ones
        tensors = load_file(str(out / common.WEIGHTS_FILE))
        save_file({k: v for k, v in tensors.items() if not k.startswith("fc_norm.")}, str(out / common.WEIGHTS_FILE),
                  metadata={"format": "pt"})
    elif fault.startswith("d2t_"):
        tensors = load_file(str(out / common.WEIGHTS_FILE))
        positions = torch.arange(len(tensors["d2t"]))
        if fault == "d2t_as_absolute_ids":
            tensors["d2t"] = tensors["d2t"] + positions
        else:  # d2t_rolled: every draft token mapped to its neighbour's target id, still one to one
            tensors["d2t"] = (tensors["d2t"] + positions).roll(1) - positions
        save_file(tensors, str(out / common.WEIGHTS_FILE), metadata={"format": "pt"})
    (out / common.CONFIG_FILE).write_text(json.dumps(config))
    return out


def reusing_engine_runs(run_dir: Path, out: Path) -> Path:
    """`out`, its engine folder holding the engine runs `run_dir`'s evaluation made, so the same requests (the plain
    run among them) are read back, not served again."""
    (out / "engine").mkdir(parents=True)
    for cached in (run_dir / "eval" / "engine").glob("runs.*"):
        shutil.copy(cached, out / "engine" / cached.name)
    return out


FP32_FAULTS = ["layer_ids_off_by_one", "norm_flag_flipped", "d2t_as_absolute_ids"]


@pytest.fixture(scope="module")
def faults_served(embedded_run, tmp_path_factory):
    """Each fault's copy of the run's vLLM export served in float32 beside our chain, in one check (our chain and
    the plain engine run, reused from the run, are shared): the report."""
    run_dir, _ = embedded_run
    out = reusing_engine_runs(run_dir, tmp_path_factory.mktemp("faults") / "check")
    export = run_dir / "eval" / "engine" / "vllm"
    exports = {fault: faulty(export, out / "exports" / fault, fault) for fault in FP32_FAULTS}
    target_cfg = TargetConfig()
    return engine_evaluation(EngineConfig(name="vllm"), served_as_in(run_dir, limit=4, max_new_tokens=48),
                             load_target(target_cfg), read_head(export), exports, served_dir(target_cfg), out)


@pytest.mark.slow
@pytest.mark.parametrize("fault", FP32_FAULTS)
def test_a_faulty_export_makes_the_engine_disagree_or_fail(faults_served, fault):
    m = faults_served["layouts"][fault]
    if m.get("failed"):  # ids past the vocabulary: vLLM stops, and that is the finding
        assert fault == "d2t_as_absolute_ids" and "out of bounds" in m["finding"], m["finding"]
        assert "FAILED" in engine.engine_summary_line(faults_served)
        return
    assert not m["counters_equal_ours"] and "differ from ours in float32" in m["finding"], fault
    # more than a near-tie could move: several prompts moved, or no single flipped draft reproduces the one's counts
    assert len(m["differing_prompts"]) > 1 or "margin" not in m["read_differently"][0], (fault, m)


def as_eagle31(head, target, seed: int = 0):
    """`head` turned Eagle 3.1 (`fc_norm`) with each norm's weights far from ones (exp(z), seeded), yet drafting
    about as trained: `fc`'s columns take each layer's median RMS (over the first prompt served) divided by those
    weights, so the norms hand `fc` its trained input rescaled per token. Served without the norms' weights, `fc`
    reads every feature off by its weight's inverse, and drafts otherwise."""
    ids = torch.tensor([target.prompt_ids(load_items("spec_bench")[0][0])])
    layers = TargetRunner(target)(ids, with_logits=False).aux_BTA[0].float().chunk(len(head.config.aux_layer_ids), -1)
    g = torch.Generator().manual_seed(seed)
    weights = [torch.exp(torch.randn(layer.shape[-1], generator=g)) for layer in layers]
    scales = torch.cat([layer.pow(2).mean(-1).sqrt().median() / w for layer, w in zip(layers, weights)])
    state = head.trainable_state_dict() | {f"fc_norm.{i}.weight": w for i, w in enumerate(weights)}
    state["fc.weight"] = head.fc.weight.detach() * scales
    return head_from_state(dataclasses.replace(head.config, fc_norm=True), state, "the Eagle 3.1 test head")


EAGLE31_SIZE = {"limit": 2, "max_new_tokens": 24}  # a plain engine run of its own, but every run and replay short


@pytest.fixture(scope="module")
def eagle31_served(embedded_run, tmp_path_factory):
    """The embedded head turned Eagle 3.1 (`as_eagle31`), exported for vLLM in float32 and served beside our chain
    (drafting with the head read back from the export), with a copy of that export whose norms' weights are gone
    (`faulty`): (the engine report, our head, the target, the evaluation settings)."""
    run_dir, _ = embedded_run
    target_cfg = TargetConfig()
    target, out, ev = load_target(target_cfg), tmp_path_factory.mktemp("eagle31"), served_as_in(run_dir, **EAGLE31_SIZE)
    export = export_eagle3(as_eagle31(read_head(run_dir / "eval" / "engine" / "vllm"), target), "vllm",
                           out / "eagle31", "float32")
    exports = {"eagle31": export, "fc_norm_dropped": faulty(export, out / "fc_norm_dropped", "fc_norm_dropped")}
    head = read_head(export)
    report = engine_evaluation(EngineConfig(name="vllm"), ev, target, head, exports, served_dir(target_cfg), out)
    return report, head, target, ev


@pytest.mark.slow
def test_vllm_serves_an_eagle31_head_exactly_as_our_chain_counts(eagle31_served):
    report, *_ = eagle31_served
    ours, n, m = report["ours"], report["num_prompts"], report["layouts"]["eagle31"]
    assert json.loads((Path(m["dir"]) / common.CONFIG_FILE).read_text())["fc_norm"] is True
    assert ours["accepted"] > 0, "the head accepts nothing: dropping its norms could not change its counts"
    assert m["weight_warnings"] == [] and m["outputs_equal_plain"] == n
    assert m["counters_equal_ours"] and m["prompts_equal_ours"] == n and m["finding"] is None, m["finding"]


@pytest.mark.slow
def test_an_eagle31_export_without_its_norms_weights_makes_vllm_disagree(eagle31_served):
    report, head, target, ev = eagle31_served
    m, k = report["layouts"]["fc_norm_dropped"], report["num_speculative_tokens"]
    assert not m["counters_equal_ours"] and "differ from ours in float32" in m["finding"], m["finding"]
    # vLLM does not check that a draft's weights all arrived: without a word, losslessly, it drafts with the norms at
    # ones, count for count as our chain does with them there
    assert m["weight_warnings"] == [] and m["outputs_equal_plain"] == report["num_prompts"]
    at_ones = copy.deepcopy(head)
    with torch.no_grad():
        for norm in at_ones.fc_norm:
            norm.weight.fill_(1.0)
    _, _, rounds = our_chain(target, at_ones, ev, k)
    assert [{key: p[key] for key in COUNTED} for p in m["per_prompt"]] == [chain_counters(r, k) for r in rounds]


def trained_beside(run_dir: Path, name: str, *overrides: str) -> Path:
    """A head trained as the embedded run's was (`+exp=engine_check` and `overrides`), on its stored data and
    features: its checkpoint directory."""
    root = run_dir.parent
    args = ["+exp=engine_check", *overrides, f"run_root={root}", f"name={name}", "stages=[prepare,capture,train]",
            f"data.path={root / 'prompts.jsonl'}", f"eval.bench={root / 'prompts.jsonl'}"]
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=3000, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "prepare: reusing" in log and "capture: reusing" in log  # the embedded run's data and features
    return trained_head_dir(root / name / "ckpt")


# Drafters whose later positions read a mask (one forward drafts the chain): how each is trained beside the embedded
# run's head, its exporter, and the fault that must make vLLM draft otherwise. A DFlash block holds
# `+exp=engine_check`'s 3 masks, so its evaluation tree is 3 deep.
PARALLEL_DRAFTERS = {
    "peagle": (["head=peagle"], export_eagle3, "mask_token_wrong"),
    "dflash": (["head=dflash", "eval.tree.depth=3"], export_dflash, "layer_ids_off_by_one"),
}


@pytest.fixture(scope="module", params=list(PARALLEL_DRAFTERS))
def parallel_served(request, embedded_run, tmp_path_factory):
    """A head of each kind in `PARALLEL_DRAFTERS` trained beside the embedded run's, exported in float32 in both
    layouts vLLM serves it from, and served beside our drafter with a copy of the vllm export carrying its fault
    (the plain engine run reused from the embedded run): (the fault, the report)."""
    overrides, export, fault = PARALLEL_DRAFTERS[request.param]
    run_dir, _ = embedded_run
    head = load_head(trained_beside(run_dir, request.param, *overrides))
    target_cfg = TargetConfig()
    out = reusing_engine_runs(run_dir, tmp_path_factory.mktemp(request.param) / "check")
    exports = {fmt: export(head, fmt, out / "exports" / fmt, "float32", str(served_dir(target_cfg)))
               for fmt in ("vllm", "speculators")}
    exports[fault] = faulty(exports["vllm"], out / "exports" / fault, fault)
    return fault, engine_evaluation(EngineConfig(name="vllm"), served_as_in(run_dir, limit=4, max_new_tokens=48),
                                    load_target(target_cfg), head, exports, served_dir(target_cfg), out)


@pytest.mark.slow
def test_vllm_serves_a_parallel_drafter_exactly_as_ours_counts(parallel_served):
    _, report = parallel_served
    ours, n = report["ours"], report["num_prompts"]
    # the mask positions draft tokens the target keeps: the fault below could change their counts
    assert ours["accepted_per_pos"][1] > 0 and ours["accepted_per_pos"][2] > 0, ours
    for layout in ("vllm", "speculators"):
        m = report["layouts"][layout]
        assert m["weight_warnings"] == [] and m["outputs_equal_plain"] == n, layout
        assert m["counters_equal_ours"] and m["prompts_equal_ours"] == n and m["finding"] is None, (layout, m["finding"])


@pytest.mark.slow
def test_a_parallel_drafter_export_with_its_fault_makes_vllm_disagree(parallel_served):
    fault, report = parallel_served
    m = report["layouts"][fault]
    assert not m["counters_equal_ours"] and "differ from ours in float32" in m["finding"], (fault, m["finding"])
    assert m["outputs_equal_plain"] == report["num_prompts"]  # still lossless: only the drafts changed


def served_as_in(run_dir: Path, **settings) -> EvalConfig:
    """The evaluation settings over the prompts the run's head learnt (`engine_prompts`)."""
    return EvalConfig(bench=str(run_dir.parent / "prompts.jsonl"), **settings)


BF16_SIZE = {"limit": 8, "max_new_tokens": 80}  # the size of each prompt set in bf16_spread.json
BF16_FAULTS = ["d2t_rolled", "norm_flag_flipped"]  # most of the test head's tau, and about a fifth: both above a tenth


@pytest.fixture(scope="module")
def bf16_served(embedded_run, tmp_path_factory):
    """The run's vLLM export and a copy of it with each fault in `BF16_FAULTS`, served in bfloat16 beside our chain
    in one check: the report."""
    run_dir, _ = embedded_run
    out = tmp_path_factory.mktemp("bf16")
    export = run_dir / "eval" / "engine" / "vllm"
    exports = {"vllm": export, **{fault: faulty(export, out / "exports" / fault, fault) for fault in BF16_FAULTS}}
    target_cfg = TargetConfig()
    return engine_evaluation(EngineConfig(name="vllm", dtype="bfloat16"), served_as_in(run_dir, **BF16_SIZE),
                             load_target(target_cfg), read_head(export), exports, served_dir(target_cfg), out)


@pytest.mark.slow
def test_bf16_engine_tau_stays_within_the_measured_bound(bf16_served):
    spread = bf16_spread()
    assert (bf16_served["num_prompts"], bf16_served["max_new_tokens"]) == (spread["prompts_per_set"],
                                                                          spread["max_new_tokens"])
    m = bf16_served["layouts"]["vllm"]
    assert m["weight_warnings"] == [] and m["finding"] is None, m["finding"]
    assert abs(m["tau_ratio_to_replay"] - 1) <= m["replay_bound"]
    # this size catches a tenth of tau lost 19 times in 20
    assert 0 < m["detectable_tau_loss"] <= 0.10 and "lower 19 times in 20" in engine.explained_differences(m)


@pytest.mark.slow
@pytest.mark.parametrize("fault", BF16_FAULTS)
def test_a_bf16_export_read_wrongly_is_a_finding(bf16_served, fault):
    m = bf16_served["layouts"][fault]
    assert m["finding"] and "beyond bfloat16 rounding" in m["finding"], m["tau_ratio_to_replay"]


# --- the script on the smoke target ---------------------------------------------------------------------


@pytest.mark.slow
def test_eval_engine_script_serves_an_export_as_the_evaluate_stage_did(embedded_run, tmp_path):
    run_dir, _ = embedded_run
    out = reusing_engine_runs(run_dir, tmp_path / "engine_eval")
    proc = subprocess.run([sys.executable, "commands/engine.py", f"head={run_dir / 'eval' / 'engine' / 'vllm'}",
                           f"bench={run_dir.parent / 'prompts.jsonl'}", "limit=4", "max_new_tokens=48",
                           f"out={out}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    served = json.loads((out / "engine.json").read_text())
    staged = json.loads((run_dir / "eval" / "engine.json").read_text())
    assert served["ours"] == staged["ours"] and served["epsilon"] == staged["epsilon"]
    assert {key: served["layouts"]["vllm"][key] for key in ("per_prompt", "finding", "outputs_equal_plain")} == {
        key: staged["layouts"]["vllm"][key] for key in ("per_prompt", "finding", "outputs_equal_plain")}
    assert "vllm 0.32.0 tau" in proc.stdout


# --- a target's own MTP module (GLM-4.5 family, tiny random) --------------------------------------------

GLM = ["+exp=smoke", "head=mtp", "target.random.family=glm4_moe", "data.synth.num_conversations=128",
       "data.synth.batch_size=64", "train.epochs=8", "train.lr=3e-3", "eval.limit=8", "eval.max_new_tokens=48",
       "eval.engine.name=vllm", "eval.engine.dtype=float32", "target.random.max_position_embeddings=8192"]


@pytest.fixture(scope="module")
def glm_mtp_run(tmp_path_factory, engine_ready):
    """A random GLM-4.5-family target whose own MTP layer the pipeline fine-tunes, then vLLM serves (method mtp)."""
    root = tmp_path_factory.mktemp("mtp")
    proc = subprocess.run([sys.executable, "train.py", *GLM, f"run_root={root}", "name=glm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "glm"


@pytest.mark.slow
def test_vllm_serves_the_fine_tuned_mtp_layer_as_our_chain_counts(glm_mtp_run):
    report = json.loads((glm_mtp_run / "eval" / "engine.json").read_text())
    ours, n, m = report["ours"], report["num_prompts"], report["layouts"]["native_mtp"]
    assert report["plain"]["outputs_equal_ours"] == n
    assert ours["accepted"] > 0, "the module accepts nothing: the faults below could not change its counts"
    assert m["layout"] == "native_mtp" and m["weight_warnings"] == [] and m["outputs_equal_plain"] == n
    # prompt by prompt count for count, our side drafting with the module read back from the served checkpoint
    assert report["epsilon"] is not None and m["prompts_equal_ours"] == n and m["counters_equal_ours"]
    assert m["finding"] is None and m["differing_prompts"] == [], m["finding"]
    export = glm_mtp_run / "export" / "native_mtp"  # over the one-file target: its model.safetensors, MTP layer in
    assert json.loads((export / common.CONFIG_FILE).read_text())["num_nextn_predict_layers"] == 1
    assert "model.layers.8.eh_proj.weight" in load_file(str(export / common.WEIGHTS_FILE))


def mtp_fault(model_dir: Path, out: Path, fault: str) -> Path:
    """A copy of the served target + MTP layer with one fault in the loader's contract: `eh_proj` reading
    cat(hidden, embedding) (the input order some checkpoints use, not GLM's), or the layer one index too far."""
    shutil.copytree(model_dir, out, symlinks=False)
    tensors = load_file(str(out / common.WEIGHTS_FILE))
    if fault == "concat_order_swapped":
        key = next(k for k in tensors if k.endswith(".eh_proj.weight"))
        half = tensors[key].shape[1] // 2
        tensors[key] = torch.cat([tensors[key][:, half:], tensors[key][:, :half]], 1).contiguous()
    elif fault == "layer_index_off_by_one":
        tensors = {k.replace("model.layers.8.", "model.layers.9."): v for k, v in tensors.items()}
    save_file(tensors, str(out / common.WEIGHTS_FILE), metadata={"format": "pt"})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["concat_order_swapped", "layer_index_off_by_one"])
def test_a_faulty_mtp_export_makes_the_engine_disagree_or_fail(glm_mtp_run, tmp_path, fault):
    out = reusing_engine_runs(glm_mtp_run, tmp_path / "out")
    target_cfg = TargetConfig(name="random", random=RandomTargetConfig(family="glm4_moe", max_position_embeddings=8192))
    target, served_model = load_target(target_cfg), glm_mtp_run / "eval" / "engine" / "native_mtp"
    head = engine.served_module(load_head(trained_head_dir(glm_mtp_run / "ckpt")), target.model, served_model)
    report = engine_evaluation(EngineConfig(name="vllm"), EvalConfig(limit=8, max_new_tokens=48), target, head,
                               {fault: mtp_fault(served_model, tmp_path / fault, fault)}, served_dir(target_cfg), out)
    m = report["layouts"][fault]
    if m.get("failed"):  # the layer where the engine does not look: vLLM refuses to start without it
        assert fault == "layer_index_off_by_one" and ("missing" in m["finding"] or "layers.9" in m["finding"]), m

        return
    assert m["outputs_equal_plain"] == report["num_prompts"]  # lossless either way: only acceptance moves
    assert not m["counters_equal_ours"] and "differ from ours in float32" in m["finding"], fault
    # more than a near-tie could move: several prompts moved, or no single flipped draft reproduces the one's counts
    assert len(m["differing_prompts"]) > 1 or "margin" not in m["read_differently"][0], (fault, m)
    moved = sum(abs(a - b) for a, b in zip(m["accepted_per_pos"], report["ours"]["accepted_per_pos"]))
    assert moved > 2, (fault, m["accepted_per_pos"], report["ours"]["accepted_per_pos"])  # beyond any near-tie
