"""Evaluation: metrics, benchmark loading, the serving-advice model, the in-training tau, and the
acceptance CLI once end to end on the random smoke target (report contract)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdistill.config import AdviceConfig, EvalConfig, HeadConfig, RunConfig, TargetConfig
from specdistill.decode import verify as verify_module
from specdistill.decode.loop import GenerationStats
from specdistill.evaluate import metrics
from specdistill.evaluate import run as evaluation
from specdistill.evaluate.advice import ModelCost, advise, expected_speedup, expected_tau, topks
from specdistill.evaluate.bench import evaluated_indices, held_out_prompts, load_items, load_prompts
from specdistill.evaluate.run import PARTIAL, Tally, evaluate, evaluate_head_tau
from specdistill.heads.build import build_head
from specdistill.heads.checkpoint import save_head
from specdistill.target import load_target

ROOT = Path(__file__).resolve().parents[1]
REPORT_KEYS = {"tau", "accept_per_depth", "new_tokens", "target_forwards", "wall_s", "baseline_wall_s", "speedup",
               "lossless_mismatches", "tree", "temperature", "num_prompts", "bench"}


def test_metrics_from_rounds():
    accepted = [0, 2, 3, 1]
    assert metrics.tau(accepted) == 2.5
    assert metrics.accept_per_depth(accepted, 4) == [0.75, 0.5, 0.25, 0.0]
    assert metrics.accept_per_depth_conditional(accepted, 4) == [0.75, 2 / 3, 0.5, 0.0]
    hits = [(1, 2, 0), (1, 2, 1), (1, 1, -1), (2, 1, 0)]
    assert metrics.coverage(hits) == [[1 / 3, 1.0], [1.0]]
    assert metrics.coverage(hits, min_rounds=2) == [[1 / 3, 1.0], []]  # depth 2 rests on one round
    assert metrics.coverage(hits, min_rounds=3) == [[1 / 3], []]


def test_tau_intervals_resample_prompts_and_pair_the_drafters():
    # head: prompt 0 has rounds (1, 3), prompt 1 (0,), prompt 2 (2, 2); the other drafter accepts one less
    # in each round of the same prompts, so each draw's ratio lies between the per-prompt ratios
    head, rounds_of = [1, 3, 0, 2, 2], [0, 0, 1, 2, 2]
    other = [max(0, a - 1) for a in head]
    out = metrics.tau_intervals({"head": head, "other": other}, {"head": rounds_of, "other": rounds_of}, 3,
                                "head", seed=0)
    lo, hi = out["head"]["tau_ci"]
    assert 1.0 <= lo < metrics.tau(head) < hi <= 3.0  # between the per-prompt taus (1.0 and 3.0)
    per_prompt = [3 / 2, 1 / 1, 3 / 2]  # tau(head) / tau(other) on prompts 0, 1, 2
    ratio_lo, ratio_hi = out["other"]["head_ratio_ci"]
    assert min(per_prompt) <= ratio_lo <= metrics.tau(head) / metrics.tau(other) <= ratio_hi <= max(per_prompt)
    assert "head_ratio_ci" not in out["head"]
    same = metrics.tau_intervals({"head": [1, 1], "copy": [1, 1]}, {"head": [0, 1], "copy": [0, 1]}, 2, "head", 0)
    assert same["head"]["tau_ci"] == [2.0, 2.0] and same["copy"]["head_ratio_ci"] == [1.0, 1.0]


def test_the_engine_counters_ratio_pairs_prompts_and_agrees_with_the_rounds_bootstrap():
    # the rounds of the test above as an engine's per-prompt counters (drafts = rounds, accepted = their sum)
    head, other, rounds_of = [1, 3, 0, 2, 2], [0, 2, 0, 1, 1], [0, 0, 1, 2, 2]

    def counters(accepted):
        return [{"drafts": rounds_of.count(p), "accepted": sum(a for a, q in zip(accepted, rounds_of) if q == p)}
                for p in range(3)]

    out = metrics.counters_tau_ratio(counters(head), counters(other), seed=0)
    by_rounds = metrics.tau_intervals({"head": head, "other": other}, {"head": rounds_of, "other": rounds_of}, 3,
                                      "head", seed=0)
    assert out["ratio"] == round(metrics.tau(head) / metrics.tau(other), 4)
    assert out["ratio_ci"] == by_rounds["other"]["head_ratio_ci"]
    assert out["tau_ci"] == [by_rounds["head"]["tau_ci"], by_rounds["other"]["tau_ci"]]
    with pytest.raises(ValueError, match="3 prompts against 2"):
        metrics.counters_tau_ratio(counters(head), counters(other)[:2], seed=0)


def test_copy_rounds_start_on_a_token_completing_a_3_gram_already_in_the_context():
    prompt = [5, 6, 7, 8]
    output = [5, 6, 7, 9, 6, 7, 9]
    # rounds start at outputs 0 (5: (7, 8, 5) is new), 1 (6: (8, 5, 6) new), 2 (7: (5, 6, 7) seen in the
    # prompt), 4 (6: (7, 9, 6) new) and 6 (9: (6, 7, 9) seen in the output)
    assert metrics.copy_rounds(prompt, output, [0, 0, 1, 1, 0]) == [False, False, True, False, True]
    assert metrics.copy_rounds([1, 2], [], []) == []


def test_benchmarks_jsonl_hf_and_held_out(tmp_path):
    path = tmp_path / "b.jsonl"
    rows = [{"turns": ["a", "b"], "category": "qa"}, {"prompt": "c"}, {"messages": [{"role": "user", "content": "d"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_items(str(path)) == [["a", "b"], ["c"], ["d"]]
    assert load_prompts(str(path), 2, max_turns=1) == ([["a"], ["c"]], ["qa", None])
    path.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"b.jsonl:1: expected"):
        load_items(str(path))
    import datasets

    datasets.Dataset.from_dict({"text": ["p", "q"]}).save_to_disk(str(tmp_path / "ds"))
    assert load_items(f"hf:{tmp_path / 'ds'}:train:text") == [["p"], ["q"]]
    with pytest.raises(ValueError, match="no column 'nope'"):
        load_items(f"hf:{tmp_path / 'ds'}:train:nope")
    evaluated = {load_items("spec_bench")[i][0] for i in evaluated_indices(480, 16)}
    held = held_out_prompts("spec_bench", 16, 8)
    assert len(held) == 8 and not evaluated & set(held)


def test_no_dev_slice_and_no_held_out_prompt_reads_a_test_row():
    test_rows = set(range(2, 480, 5))
    assert evaluated_indices(480, 96, "test") == sorted(test_rows)
    assert evaluated_indices(480, 16, "test") == list(range(2, 480, 30))
    for limit in range(1, 481):
        dev = evaluated_indices(480, limit)
        assert len(dev) == len(set(dev)) == min(limit, 384), limit
        assert not set(dev) & test_rows, limit
    # the slices the earlier results were measured on are dev rows, and unchanged
    assert evaluated_indices(480, 16) == list(range(0, 480, 30))
    assert evaluated_indices(480, 96) == list(range(0, 480, 5))
    items = load_items("spec_bench")
    test_prompts = {items[i][0] for i in test_rows}
    assert not test_prompts & set(held_out_prompts("spec_bench", 16, 64))
    assert {turns[0] for turns in load_prompts("spec_bench", 96, split="test")[0]} == test_prompts
    with pytest.raises(ValueError, match="eval.split"):
        load_prompts("spec_bench", 4, split="train")


def llama8b_like() -> tuple[ModelCost, ModelCost]:
    target = ModelCost(params=7_500_000_000, layers=32, attn_width=4096, kv_bytes_per_token=131072)
    head = ModelCost(params=400_000_000, layers=1, attn_width=4096, kv_bytes_per_token=4096)
    return target, head


def test_expected_tau_keeps_the_best_draft_tokens_of_the_engines_tree():
    # rank marginals 0.5 and 0.2 at every depth: depth-1 candidates 0.5, 0.2; depth 2 (both expanded)
    # 0.25, 0.1, 0.1, 0.04. Three draft tokens keep 0.5, 0.25 and 0.2 (the root's second child beats the
    # rank-2 child of the first), not a width-1 chain of 0.5, 0.25
    table = [[0.5, 0.7]]
    assert expected_tau(table, 2, 2, 3) == pytest.approx(1.95)
    assert expected_tau(table, 2, 2, 6) == pytest.approx(2.19)
    assert expected_tau(table, 2, 1, 2) == pytest.approx(1.75)
    assert expected_tau([[0.5, 0.4]], 2, 2, 6) == expected_tau([[0.5]], 2, 1, 2)  # noise never makes rank 2 negative


def test_advice_speedup_falls_as_batch_grows():
    table = [[0.75, 0.85, 0.9, 0.92]] + [[0.7, 0.8, 0.85, 0.88]] * 5
    assert expected_tau(table, 1, 1, 1) == pytest.approx(1.75)
    assert expected_tau(table, 6, 4, 48) > expected_tau(table, 6, 1, 6) > expected_tau(table, 3, 1, 3)
    target, head = llama8b_like()
    cfg = AdviceConfig()
    fixed = [expected_speedup(3.0, 6, 8, 60, b, target, head, cfg) for b in cfg.batch_sizes]
    # flat while memory-bound (within 1%: fixed drafting costs thin out as KV reads grow), then falling
    assert all(a >= 0.99 * b for a, b in zip(fixed, fixed[1:])) and fixed[0] > 1.5 > 1.0 > fixed[-1]
    evaluated = [{"drafter": "head tree", "depth": 6, "topk": 4, "num_draft_tokens": 48, "tau": 3.4},
                 {"drafter": "chain", "depth": 6, "topk": 1, "num_draft_tokens": 6, "tau": 2.9}]
    advice = advise(table, target, head, cfg, "eagle3", {"sglang": "/run/export/sglang", "vllm": "/run/export/vllm"},
                    evaluated)
    expected = [pytest.approx(expected_tau(table, 6, 4, 48), abs=1e-3), pytest.approx(expected_tau(table, 6, 1, 6),
                                                                                       abs=1e-3)]
    assert advice["model_check"] == [{**e, "expected_tau": x} for e, x in zip(evaluated, expected)]
    best = [r["expected_speedup"] for r in advice["per_batch"]]
    assert all(a >= 0.99 * b for a, b in zip(best, best[1:])) and best[-1] < 0.8 * best[0]
    small, large = advice["per_batch"][0], advice["per_batch"][-1]
    assert small["num_draft_tokens"] >= large["num_draft_tokens"] or not large["speculate"]
    assert f"--speculative-num-draft-tokens {small['num_draft_tokens'] + 1}" in small["sglang"]
    assert '"num_speculative_tokens"' in small["vllm"] and "--speculative-eagle-topk" in small["sglang"]
    assert "path /run/export/sglang " in small["sglang"] and '"model": "/run/export/vllm"' in small["vllm"]


def test_advice_weighs_every_top_k_the_evaluation_measured():
    assert topks(16) == [1, 2, 4, 8, 16] and topks(12) == [1, 2, 4, 8, 12] and topks(1) == topks(0) == [1]
    # coverage that keeps rising up to width 16 (a top-k 16 evaluation tree): at batch 1 the widest tree wins
    table = [[min(0.3 + 0.03 * w, 0.9) for w in range(1, 17)]] * 4
    target, head = llama8b_like()
    evaluated = [{"drafter": "head tree", "depth": 4, "topk": 16, "num_draft_tokens": 60, "tau": 2.0}]
    advice = advise(table, target, head, AdviceConfig(), "eagle3", {"sglang": "s", "vllm": "v"}, evaluated)
    assert advice["per_batch"][0]["topk"] == 16
    narrow = advise([row[:8] for row in table], target, head, AdviceConfig(), "eagle3", {"sglang": "s", "vllm": "v"},
                    evaluated)
    assert max(r["topk"] for r in narrow["per_batch"]) <= 8


def test_a_peagle_head_is_advised_vllm_chains_drafted_in_one_forward():
    table = [[min(0.3 + 0.03 * w, 0.9) for w in range(1, 17)]] * 4
    target, head = llama8b_like()
    evaluated = [{"drafter": "head tree", "depth": 4, "topk": 1, "num_draft_tokens": 4, "tau": 2.0}]
    parallel = advise(table, target, head, AdviceConfig(), "eagle3", {"vllm": "v"}, evaluated, parallel=True)
    serial = advise(table, target, head, AdviceConfig(), "eagle3", {"sglang": "s", "vllm": "v"}, evaluated)
    for row, chain in zip(parallel["per_batch"], serial["per_batch"]):
        assert row["topk"] == 1 and row["sglang"] == "(no SGLang layout: a P-EAGLE or DFlash head is served by vLLM)"
        assert row["vllm_expected_speedup"] >= chain["vllm_expected_speedup"]  # one forward drafts every depth
        assert '"parallel_drafting": true' in row["vllm"] or row["vllm_expected_speedup"] <= 1
        assert "parallel_drafting" not in chain["vllm"]


def test_a_dflash_head_is_advised_vllm_chains_of_its_block_by_its_own_method():
    table = [[min(0.5 + 0.03 * w, 0.95) for w in range(1, 17)]] * 8  # deep acceptance: longer chains would pay
    target, head = llama8b_like()
    evaluated = [{"drafter": "head tree", "depth": 8, "topk": 1, "num_draft_tokens": 8, "tau": 3.0}]
    advice = advise(table, target, head, AdviceConfig(), "dflash", {"vllm": "v"}, evaluated, parallel=True,
                    max_steps=3)
    unbounded = advise(table, target, head, AdviceConfig(), "dflash", {"vllm": "v"}, evaluated, parallel=True)
    assert max(r["steps"] for r in unbounded["per_batch"]) > 3  # the bound binds
    for row in advice["per_batch"]:
        assert row["topk"] == 1 and row["steps"] <= 3 and row["vllm_steps"] <= 3
        assert '"method": "dflash"' in row["vllm"] or row["vllm_expected_speedup"] <= 1
        assert "parallel_drafting" not in row["vllm"]


@pytest.fixture(scope="module")
def smoke_head(tmp_path_factory):
    target = load_target(TargetConfig(name="random"))
    ids = torch.arange(0, target.vocab_size, 2)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(0)
    head = build_head(HeadConfig(kind="eagle3"), target, ids - torch.arange(len(ids)), t2d)
    directory = tmp_path_factory.mktemp("head")
    save_head(head, directory)
    return target, head, directory


def test_tally_splits_per_depth_acceptance_by_copy_rounds():
    # prompt 1 2 3 4 5 6 1 2: the first round starts on 3, completing (1, 2, 3) again, and copies 4 5 6
    # (accepted 3); the next two start on 7 and 8, new 3-grams, and accept 0 and 1
    prompt, output, accepted = [1, 2, 3, 4, 5, 6, 1, 2], [3, 4, 5, 6, 7, 8, 9], [3, 0, 1]
    stats = GenerationStats(tokens=[output], accepted=[accepted])
    tally = Tally(depth=4)
    tally.add(stats, 1.0, [output], [prompt], [None])
    tally.add(stats, 1.0, [output[:-1] + [0]], [prompt], [None])  # the same rounds against a reference they miss
    tally.add(stats, 1.0, None, [prompt], [None])  # no plain decoding: nothing to check
    report = tally.report(baseline_wall_s=1.0, greedy=True)
    assert report["accept_per_depth_conditional_copy"] == [1.0, 1.0, 1.0, 0.0]
    assert report["accept_per_depth_conditional_elsewhere"] == [0.5, 0.0, 0.0, 0.0]
    assert report["copy_round_share"] == pytest.approx(1 / 3) and report["lossless_mismatches"] == 1


def test_in_loop_tau_on_held_out_prompts(smoke_head):
    target, head, _ = smoke_head
    head.train()
    cfg = EvalConfig(loop_max_new_tokens=8, batch_size=1)
    cfg.tree.depth, cfg.tree.topk, cfg.tree.num_draft_tokens = 3, 4, 12
    result = evaluate_head_tau(head, target, held_out_prompts("spec_bench", 16, 2), cfg)
    assert len(result["accept_per_depth"]) == 3 and result["new_tokens"] == 2 * 8
    # tau against the target forwards it took: one per round besides each prompt's prefill. The rounds commit
    # the 7 tokens after each prompt's first, overshooting by at most a tree's depth in the last round
    rounds = result["target_forwards"] - 2
    committed = result["tau"] * rounds
    assert committed == pytest.approx(round(committed)) and 2 * 7 <= round(committed) <= 2 * (7 + 3)
    assert result["tau"] == pytest.approx(1 + sum(result["accept_per_depth"]))
    assert {"tau_copy", "tau_elsewhere", "copy_round_share"} <= result.keys()
    assert head.training  # left as it was


def test_acceptance_cli_writes_the_report_contract(smoke_head, tmp_path):
    _, _, head_dir = smoke_head
    bench = tmp_path / "bench.jsonl"
    bench.write_text("\n".join(json.dumps(r) for r in [{"turns": ["Hi there", "Say it again"], "category": "chat"},
                                                       {"prompt": "2+2=", "category": "math"},
                                                       {"prompt": "A test-split row, never read"},
                                                       {"prompt": "Tell me a story"}]) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "commands/evaluate.py", f"head={head_dir}", "target=random", f"bench={bench}", "limit=3",
         "max_new_tokens=8", f"out={out}", "wandb.mode=disabled", "eval.batch_size=2", "eval.max_turns=2",
         "eval.baselines=[prompt_lookup,chain]",
         "eval.tree.depth=3", "eval.tree.topk=4", "eval.tree.num_draft_tokens=12"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tau" in proc.stdout and str(out / "report.json") in proc.stdout
    report = json.loads((out / "report.json").read_text())
    printed = proc.stdout.split("(baselines: ")[1].split(")")[0].split(", ")  # only the baselines that ran
    assert sorted(printed) == sorted(f"{name} {b['tau']:.2f}" for name, b in report["baselines"].items())
    assert REPORT_KEYS <= report.keys()
    assert report["lossless_mismatches"] == 0 and report["num_prompts"] == 4
    assert_rounds_commit_the_outputs(report, report_rows(out))
    assert len(report["accept_per_depth"]) == 3
    for m in (report, *report["baselines"].values()):  # the split rounds add back up to tau
        share = m["copy_round_share"]
        assert m["tau"] == pytest.approx(share * m["tau_copy"] + (1 - share) * m["tau_elsewhere"])
    for item, name in enumerate(["chat", "math"]):  # item 2 has no category: it counts only in the overall tau
        rounds = [a for r in report_rows(out) if r["item"] == item for a in r["accepted_per_round"]]
        assert report["tau_by_category"][name] == pytest.approx(metrics.tau(rounds))
    assert all(set(m["tau_by_category"]) == {"chat", "math"} for m in (report, *report["baselines"].values()))
    assert report["tree"] == {"depth": 3, "topk": 4, "num_draft_tokens": 12}
    plain = [t for r in report_rows(out) for t in r["plain_output_ids"]]  # the head's draft vocab: even ids
    assert report["outside_draft_vocab"] == pytest.approx(sum(t % 2 for t in plain) / len(plain))
    assert {"prompt_lookup", "chain"} == set(report["baselines"])
    assert all(b["lossless_mismatches"] == 0 for b in report["baselines"].values())
    for m in (report, *report["baselines"].values()):
        assert m["tau_ci"][0] <= m["tau"] <= m["tau_ci"][1]
    for b in report["baselines"].values():
        assert b["head_ratio"] == pytest.approx(report["tau"] / b["tau"])
        assert b["head_ratio_ci"][0] <= b["head_ratio"] <= b["head_ratio_ci"][1]
    assert len(report["serving_advice"]["per_batch"]) == len(AdviceConfig().batch_sizes)
    tree_check, chain_check = report["serving_advice"]["model_check"]
    assert tree_check["tau"] == round(report["tau"], 3) and tree_check["num_draft_tokens"] == 12
    assert chain_check["tau"] == round(report["baselines"]["chain"]["tau"], 3) and chain_check["topk"] == 1
    rows = report_rows(out)
    second = next(r for r in rows if r["turn"] == 1)
    first = next(r for r in rows if r["turn"] == 0 and r["item"] == second["item"])
    assert len(second["prompt_ids"]) > len(first["prompt_ids"]) + 1  # the first answer is in the history
    assert all(r["output_ids"] == r["plain_output_ids"] for r in rows)
    assert (out / "acceptance.png").stat().st_size > 0
    summary = (out / "summary.md").read_text()
    assert "| tau by category | chat | math |" in summary and "95% interval over prompts [" in summary
    lookup = report["baselines"]["prompt_lookup"]
    assert "| drafter | copy rounds | elsewhere |" in summary and (
        "| prompt_lookup | " + " | ".join(" ".join(f"{a:.2f}" for a in lookup[f"accept_per_depth_conditional_{kind}"])
                                          for kind in ("copy", "elsewhere")) + " |") in summary
    assert "## Serving advice" in summary and "| 256 |" in summary and "prompt_lookup" in summary
    assert "Model check: the head tree (depth 3, top-k 4, 12" in summary and "Model check: the chain (depth 3" in summary


def test_a_killed_evaluation_resumes_from_its_finished_batches(smoke_head, tmp_path, monkeypatch):
    target, head, _ = smoke_head
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"turns": [f"Question {i}", "And then?"]}) + "\n" for i in range(4)))  # row 2: test
    cfg = RunConfig()
    cfg.wandb.mode = "disabled"
    ev = cfg.eval  # 3 items x 2 turns, one per batch: 6 batches of 3 drafters each
    ev.bench, ev.limit, ev.max_turns, ev.max_new_tokens, ev.baselines = str(bench), 3, 2, 6, ["prompt_lookup", "chain"]
    ev.temperature = 0.8  # sampled: the random generators must continue where the killed sitting left them
    ev.tree.depth, ev.tree.topk, ev.tree.num_draft_tokens = 3, 4, 12
    fresh = evaluate(cfg, target, head, tmp_path / "fresh")

    calls, decode = [], evaluation.speculative_generate

    def counted(*args):
        calls.append(args)
        if kill_at and len(calls) == kill_at:
            raise KeyboardInterrupt
        return decode(*args)

    monkeypatch.setattr(evaluation, "speculative_generate", counted)
    kill_at = 3 * 3 + 2  # killed in the fourth batch: the first of the second turn
    with pytest.raises(KeyboardInterrupt):
        evaluate(cfg, target, head, tmp_path / "resumed")
    other = copy.deepcopy(head)
    other.fc.weight.data += 0.01
    calls.clear()
    kill_at = 1  # another head re-uses nothing: it starts again from the first turn
    with pytest.raises(KeyboardInterrupt):
        evaluate(cfg, target, other, tmp_path / "resumed")
    assert "And then?" not in target.tokenizer.decode(calls[0][2][0])
    calls.clear()
    kill_at = 0
    resumed = evaluate(cfg, target, head, tmp_path / "resumed")
    assert len(calls) == 3 * 3 and resumed["resumed_batches"] == 3 and fresh["resumed_batches"] == 0
    assert report_rows(tmp_path / "resumed") == report_rows(tmp_path / "fresh")
    for name in ("prompt_lookup", "chain"):
        assert resumed["baselines"][name]["accept_per_depth"] == fresh["baselines"][name]["accept_per_depth"]
    assert (resumed["tau"], resumed["new_tokens"]) == (fresh["tau"], fresh["new_tokens"])
    assert not (tmp_path / "resumed" / PARTIAL).exists()
    assert "3 batches and their times come from a killed earlier sitting" in (tmp_path / "resumed" / "summary.md").read_text()


def report_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]


def assert_rounds_commit_the_outputs(report: dict, rows: list[dict]) -> None:
    """tau is computed from rounds; the rows' tokens hold it to them: each row's rounds before its last fell short
    of its output and all of them reach it (the prefill commits the first token, a round its accepted + 1)."""
    for row in rows:
        rounds, tokens = row["accepted_per_round"], len(row["output_ids"])
        before_last = 1 + sum(a + 1 for a in rounds[:-1])
        assert (before_last < tokens <= before_last + rounds[-1] + 1) if rounds else tokens == 1, (rounds, tokens)
    assert report["tau"] == pytest.approx(metrics.tau([a for row in rows for a in row["accepted_per_round"]]))


def test_a_wrong_verification_is_caught_by_the_lossless_check(smoke_head, tmp_path, monkeypatch):
    target, head, _ = smoke_head
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi there", "2+2=")))
    cfg = RunConfig()
    cfg.wandb.mode = "disabled"
    ev = cfg.eval
    ev.bench, ev.limit, ev.max_new_tokens, ev.batch_size, ev.baselines = str(bench), 2, 8, 2, []
    ev.tree.depth, ev.tree.topk, ev.tree.num_draft_tokens = 3, 4, 12
    flipped, verify = [], verify_module.verify_greedy

    def flip_one_token(tree, logits):  # the first round's first committed token of row 0 turned into another
        verdict = verify(tree, logits)
        if not flipped:
            flipped.append(True)
            verdict.tokens[0, 0] = (verdict.tokens[0, 0] + 1) % target.vocab_size
        return verdict

    monkeypatch.setattr(verify_module, "verify_greedy", flip_one_token)
    report = evaluate(cfg, target, head, tmp_path / "out")
    assert flipped and report["lossless_mismatches"] == 1
    assert sorted(r["matches_plain"] for r in report_rows(tmp_path / "out")) == [False, True]


def test_acceptance_cli_names_a_missing_head(tmp_path):
    proc = subprocess.run([sys.executable, "commands/evaluate.py", f"head={tmp_path / 'none'}", "target=random"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "none" in proc.stdout + proc.stderr
