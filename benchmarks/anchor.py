"""Our EAGLE-3 head against the one vLLM's `speculators` trainer (its own code and defaults) makes from the same
run's data and features, at the same optimizer steps and tokens a step; vLLM serves both.

    python benchmarks/anchor.py runs/<name> [--prompts 96] [--max-new-tokens 128] [--dtype bfloat16]

1. The run's captured features in speculators' layout (`specdistill/anchor.py`): it trains on our training rows,
   validates on our held-out rows and drafts our draft vocabulary.
2. speculators' EAGLE-3 (muon, kl_div, 3 TTT steps, norm_before_fc and norm_output, packed rows: its defaults) for
   as many optimizer steps as the run's head took, each a packed row of the run's mean tokens a step.
3. Seconds per step at equal precision, float32 (a CPU turns speculators' autocast off): speculators' own step
   timing over its whole run; ours over `--timing-steps` steps of the run's recipe in float32 (run `<name>-fp32`).
4. vLLM serves the plain target, our head and theirs on `--prompts` frozen test-split prompts, a chain of `--k`,
   one request at a time: tau with a paired 95% interval, acceptance per position, tokens/s.

Writes <run>/anchor/anchor.json, prints ours against theirs and ends with `RESULT baseline=speculators
tau_ratio=... s_per_step_ratio=... per_token_ratio=...` (ours / theirs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
from pathlib import Path

from specdistill.anchor import (
    check_layer_ids,
    speculators_arguments,
    speculators_layer_ids,
    step_seconds,
    step_tokens,
    train_speculators,
    write_inputs,
)
from specdistill.capture.store import FeatureStore
from specdistill.config import run_config_of
from specdistill.data.vocab import DraftVocab
from specdistill.engines import engine_python
from specdistill.evaluate.bench import conversation_ids, load_prompts
from specdistill.evaluate.counters import served_summary
from specdistill.evaluate.engine import run_worker, serve_request
from specdistill.evaluate.metrics import counters_tau_ratio
from specdistill.export import export_eagle3
from specdistill.heads.checkpoint import load_head
from specdistill.io import write_json
from specdistill.layout import RunLayout
from specdistill.pipeline import run_stages
from specdistill.target import load_target, served_dir
from specdistill.train.data import holdout_split


def tokens_by_step(layout: RunLayout, store: FeatureStore, grad_accum: int) -> list[int]:
    """The tokens each optimizer step of a run trained on, its ranks together (`train/samples-rank-R.json` holds
    each rank's micro-batches, `grad_accum` of them to a step)."""
    per_rank = [[sum(store.lengths[i] for i in batch["ids"]) for batch in json.loads(path.read_text())["micro_batches"]]
                for path in layout.train_dir.glob("samples-rank-*.json")]
    return [sum(sum(rank[s : s + grad_accum]) for rank in per_rank) for s in range(0, len(per_rank[0]), grad_accum)]


def trained_budget(cfg, layout: RunLayout, store: FeatureStore) -> dict:
    """The run's optimizer steps and the tokens its ranks trained on."""
    steps = json.loads((layout.train_dir / "history.json").read_text())[-1]["step"]
    tokens = sum(tokens_by_step(layout, store, cfg.train.grad_accum))
    return {"steps": steps, "tokens": tokens, "tokens_per_step": round(tokens / steps)}


def our_fp32_steps(cfg, store: FeatureStore, steps: int) -> dict:
    """Seconds and tokens a step of our trainer on the run's data (`store`) and recipe in float32, over `steps`
    steps (the first, which warms up, left out)."""
    timing = dataclasses.replace(cfg, name=f"{cfg.name}-fp32", stages=["train"], restart=True,
                                 wandb=dataclasses.replace(cfg.wandb, mode="disabled"),
                                 train=dataclasses.replace(cfg.train, max_steps=steps, mixed_precision="no",
                                                           eval_every=0, ckpt_every=steps))
    run_stages(timing)
    layout = RunLayout.of(timing)
    seconds = [h["step_s"] for h in json.loads((layout.train_dir / "history.json").read_text())]
    return per_step(seconds[1:], tokens_by_step(layout, store, cfg.train.grad_accum)[1:])


def per_step(seconds: list[float], tokens: list[int]) -> dict:
    return {"steps_timed": len(seconds), "s_per_step": round(statistics.fmean(seconds), 4),
            "tokens_per_step": round(statistics.fmean(tokens)), "ms_per_1k_tokens": round(1e6 * sum(seconds) / sum(tokens), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run directory whose train stage finished")
    parser.add_argument("--prompts", type=int, default=96, help="frozen test-split prompts served")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="the chain vLLM drafts")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="vLLM serves in it")
    parser.add_argument("--timing-steps", type=int, default=20, help="steps of ours timed in float32")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    cfg = run_config_of(args.run)
    layout = RunLayout.of(cfg)
    store, vocab = FeatureStore(layout.features_dir), DraftVocab.load(layout.vocab_file)
    train_ids, holdout_ids = holdout_split(len(store), cfg.train.holdout_share, cfg.seed)
    budget = trained_budget(cfg, layout, store)
    target = load_target(cfg.target)
    target_dir = served_dir(cfg.target)
    inputs = layout.anchor_dir / "inputs"
    written = write_inputs(store, train_ids, holdout_ids, vocab, inputs)
    their_layer_ids = speculators_layer_ids(target.layer_ids)
    check_layer_ids(target.model, inputs, their_layer_ids)
    arguments = speculators_arguments(inputs, written, target_dir, layout.anchor_dir / "speculators", their_layer_ids,
                                      budget["steps"], budget["tokens_per_step"])
    theirs = train_speculators(arguments, layout.anchor_dir / "speculators")
    timing = {"precision": "float32", "ours": our_fp32_steps(cfg, store, args.timing_steps),
              "speculators": per_step(step_seconds(theirs["steps"])[1:], step_tokens(theirs["steps"])[1:])}
    timing["s_per_step_ratio"] = round(timing["ours"]["s_per_step"] / timing["speculators"]["s_per_step"], 3)
    timing["per_token_ratio"] = round(timing["ours"]["ms_per_1k_tokens"] / timing["speculators"]["ms_per_1k_tokens"], 3)

    items, _ = load_prompts(cfg.eval.bench, args.prompts, 1, "test")
    request = serve_request(target, target_dir, [conversation_ids(target.tokenizer, turns, []) for turns in items],
                            args.k, args.dtype, args.max_new_tokens)
    python, work = engine_python("vllm", None, "benchmarks/anchor.py"), layout.anchor_dir / "engine"
    ours_dir = export_eagle3(load_head(layout.trained_head_dir()), "speculators", layout.anchor_dir / "ours",
                             args.dtype, str(target_dir), speculative_tokens=args.k)
    plain = run_worker("vllm", python, request, work, "plain")
    heads = {name: {"dir": str(d), **served_summary(run_worker("vllm", python, {**request, "draft": str(d),
                                                                         "layout": "speculators"}, work, name), plain)}
             for name, d in (("ours", ours_dir), ("speculators", Path(theirs["checkpoint"])))}
    comparison = counters_tau_ratio(heads["ours"]["per_prompt"], heads["speculators"]["per_prompt"], cfg.seed)
    report = {"run": str(args.run), "speculators_arguments": arguments, "inputs": written, "ours_trained": budget,
              "speculators_trained": {"steps": len(theirs["steps"]), "tokens": sum(step_tokens(theirs["steps"]))},
              "timing": timing, "engine": {"version": plain["version"], "dtype": args.dtype, "k": args.k,
                                          "split": "test", "prompts": len(items), "max_new_tokens": args.max_new_tokens,
                                          "plain_tokens_per_s": round(sum(map(len, plain["outputs"])) / plain["wall_s"], 2)},
              "heads": heads, "tau_ratio": comparison}
    write_json(layout.anchor_dir / "anchor.json", report)
    print_report(report, layout.anchor_dir / "anchor.json")


def print_report(r: dict, path: Path) -> None:
    e, ours, theirs, t = r["engine"], r["heads"]["ours"], r["heads"]["speculators"], r["timing"]
    print(f"trained: ours {r['ours_trained']['steps']} steps, {r['ours_trained']['tokens']} tokens; speculators "
          f"{r['speculators_trained']['steps']} steps, {r['speculators_trained']['tokens']} tokens")
    print(f"vLLM {e['version']} tau ({e['dtype']}, chain of {e['k']}, {e['prompts']} test prompts x "
          f"{e['max_new_tokens']} tokens): ours {ours['tau']:.3f} {r['tau_ratio']['tau_ci'][0]}, speculators "
          f"{theirs['tau']:.3f} {r['tau_ratio']['tau_ci'][1]}; ours / speculators {r['tau_ratio']['ratio']:.3f}x "
          f"{r['tau_ratio']['ratio_ci']}")
    print(f"acceptance per position: ours {ours['acceptance_per_pos']}, speculators {theirs['acceptance_per_pos']}")
    print(f"tokens/s: plain {e['plain_tokens_per_s']}, ours {ours['tokens_per_s']}, speculators "
          f"{theirs['tokens_per_s']}; outputs equal plain: ours {ours['outputs_equal_plain']}/{e['prompts']}, "
          f"speculators {theirs['outputs_equal_plain']}/{e['prompts']}")
    print(f"seconds per step ({t['precision']}): ours {t['ours']['s_per_step']} ({t['ours']['tokens_per_step']} tokens), "
          f"speculators {t['speculators']['s_per_step']} ({t['speculators']['tokens_per_step']} tokens); ours / "
          f"speculators {t['s_per_step_ratio']}x a step, {t['per_token_ratio']}x a token")
    print(f"written to {path}")
    print(f"RESULT baseline=speculators tau_ratio={r['tau_ratio']['ratio']:.3f} "
          f"s_per_step_ratio={t['s_per_step_ratio']:.3f} per_token_ratio={t['per_token_ratio']:.3f}")


if __name__ == "__main__":
    main()
