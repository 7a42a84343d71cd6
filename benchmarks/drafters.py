"""EAGLE-3, Eagle 3.1, P-EAGLE and DFlash heads at equal budget: the same run's data and features, the same recipe and
optimizer steps, each served by vLLM on the same frozen test-split prompts in one sitting.

    python benchmarks/drafters.py runs/<name> [--prompts 96] [--max-new-tokens 128] [--k 3] [--dtype bfloat16]

1. The run's own head is the EAGLE-3 entry; each other drafter is trained as run `<name>-<drafter>` with the run's
   config and only its head settings changed (`head.fc_norm=true`, `head=peagle`, `head=dflash`), so it reads the run's stored
   data and features and takes as many optimizer steps.
2. Each head is exported in the vllm layout (`--dtype`) and served with the plain target on `--prompts` test-split
   prompts, a chain of `--k`, one request at a time: tau with a paired 95% interval against EAGLE-3, acceptance
   per position, tokens/s beside plain decoding's, every engine run (plain included) made afresh in this sitting.

Writes <run>/drafters/drafters.json, prints the table and ends with `RESULT baseline=eagle3 <drafter>_tau_ratio=...
<drafter>_tokens_per_s_ratio=...` (each against the run's EAGLE-3 head).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

from specdistill.config import run_config_of
from specdistill.engines import engine_python
from specdistill.evaluate.bench import conversation_ids, load_prompts
from specdistill.evaluate.counters import served_summary
from specdistill.evaluate.engine import run_worker, serve_request
from specdistill.evaluate.metrics import counters_tau_ratio
from specdistill.export import export_dflash, export_eagle3
from specdistill.heads.checkpoint import load_head
from specdistill.io import write_json
from specdistill.layout import RunLayout
from specdistill.pipeline import run_stages
from specdistill.target import load_target, served_dir

DRAFTERS = {"eagle3": {}, "eagle31": {"fc_norm": True}, "peagle": {"parallel_drafting": True},
            "dflash": {"kind": "dflash", "copy_init": False}}


def trained(cfg, drafter: str) -> tuple[RunLayout, dict]:
    """The drafter's run (the base run itself for EAGLE-3, else trained now or found trained): its layout and its
    steps and training seconds."""
    if DRAFTERS[drafter]:
        depth = min(cfg.eval.tree.depth, cfg.train.ttt_steps) if drafter == "dflash" else cfg.eval.tree.depth
        tree = dataclasses.replace(cfg.eval.tree, depth=depth)  # a DFlash head drafts at most the masks it trains
        cfg = dataclasses.replace(cfg, name=f"{cfg.name}-{drafter}", stages=["train"],
                                  wandb=dataclasses.replace(cfg.wandb, mode="disabled"),
                                  head=dataclasses.replace(cfg.head, **DRAFTERS[drafter]),
                                  eval=dataclasses.replace(cfg.eval, tree=tree))
        run_stages(cfg)
    layout = RunLayout.of(cfg)
    history = json.loads((layout.train_dir / "history.json").read_text())
    return layout, {"steps": history[-1]["step"], "train_s": round(sum(h["step_s"] for h in history), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run directory whose train stage finished")
    parser.add_argument("--drafters", default=",".join(DRAFTERS), help=f"a comma list of {list(DRAFTERS)}")
    parser.add_argument("--prompts", type=int, default=96, help="frozen test-split prompts served")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3, help="the chain vLLM drafts")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="vLLM serves in it")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    drafters = args.drafters.split(",")
    if unknown := sorted(set(drafters) - set(DRAFTERS)):
        parser.error(f"--drafters: {unknown} unknown; expected some of {list(DRAFTERS)}")

    cfg = run_config_of(args.run)
    out = RunLayout.of(cfg).run_dir / "drafters"
    runs = {name: trained(cfg, name) for name in drafters}
    target = load_target(cfg.target)
    target_dir = served_dir(cfg.target)
    items, _ = load_prompts(cfg.eval.bench, args.prompts, 1, "test")
    request = serve_request(target, target_dir, [conversation_ids(target.tokenizer, turns, []) for turns in items],
                            args.k, args.dtype, args.max_new_tokens)
    # tokens/s are compared within one sitting only (they move by a fifth between sittings here), so every engine run
    # is made afresh in a folder of this sitting's, never read back from an earlier one's cache
    python, work = engine_python("vllm", None, "benchmarks/drafters.py"), out / "engine" / time.strftime("%Y%m%d-%H%M%S")
    logging.info("this sitting's engine runs: %s", work)
    plain = run_worker("vllm", python, request, work, "plain")
    heads = {}
    for name, (layout, budget) in runs.items():
        write = export_dflash if name == "dflash" else export_eagle3
        export = write(load_head(layout.trained_head_dir()), "vllm", out / "exports" / name, args.dtype)
        result = run_worker("vllm", python, {**request, "draft": str(export), "layout": "vllm"}, work, name)
        heads[name] = {"run": str(layout.run_dir), **budget, **served_summary(result, plain)}
    base = drafters[0]
    for name in drafters[1:]:
        heads[name]["tau_ratio"] = counters_tau_ratio(heads[name]["per_prompt"], heads[base]["per_prompt"], cfg.seed)
    report = {"run": str(args.run), "baseline": base,
              "engine": {"version": plain["version"], "dtype": args.dtype, "k": args.k, "split": "test", "runs": str(work),
                         "prompts": len(items), "max_new_tokens": args.max_new_tokens,
                         "plain_tokens_per_s": round(sum(map(len, plain["outputs"])) / plain["wall_s"], 2)},
              "heads": heads}
    write_json(out / "drafters.json", report)
    print_table(report, out / "drafters.json")


def print_table(r: dict, path: Path) -> None:
    e = r["engine"]
    print(f"vLLM {e['version']}, {e['dtype']}, chain of {e['k']}, {e['prompts']} test prompts x {e['max_new_tokens']} "
          f"tokens; plain decoding {e['plain_tokens_per_s']} tokens/s")
    print(f"| drafter | steps | train s | tau [95%] | / {r['baseline']} [95%] | accepted per position | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ratios = [h["tau_ratio"] for h in r["heads"].values() if "tau_ratio" in h]
    for name, h in r["heads"].items():
        ratio = h.get("tau_ratio")
        tau_ci = ratio["tau_ci"][0] if ratio else ratios[0]["tau_ci"][1] if ratios else ""  # the baseline's, paired
        against = f"{ratio['ratio']:.3f} {ratio['ratio_ci']}" if ratio else "1"
        print(f"| {name} | {h['steps']} | {h['train_s']} | {h['tau']:.3f} {tau_ci} | {against} | "
              f"{h['acceptance_per_pos']} | {h['tokens_per_s']} |")
    print(f"written to {path}")
    fields = [f"{name}_tau_ratio={h['tau_ratio']['ratio']:.3f} "
              f"{name}_tokens_per_s_ratio={h['tokens_per_s'] / r['heads'][r['baseline']]['tokens_per_s']:.3f}"
              for name, h in r["heads"].items() if "tau_ratio" in h]
    print(f"RESULT baseline={r['baseline']} " + " ".join(fields))


if __name__ == "__main__":
    main()
