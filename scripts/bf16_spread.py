"""Measure how far a correct export's bfloat16 engine tau strays from ours, the spread the engine check's bfloat16
bound is taken from.

    python scripts/bf16_spread.py --sets 8 --prompts 16 --max-new-tokens 80

In bfloat16 the engine's and our decodes part ways by rounding, so the check compares the two taus in standard
errors (`engine.tau_z`). Draft outcomes within a prompt are correlated and both sides decode the same prompts, so
that z is not a standard normal: its spread is measured here, on a head trained as the engine tests train theirs
(`+exp=engine_check`: the target's answers to the prompts served, here as many as the sets hold, as many epochs),
exported as it is served (vLLM layout, bfloat16) and served one request at a time on `sets` x `prompts`
Spec-Bench dev prompts; each set of `prompts` (the engine check's size in CI) gives one z. The bound is 3 x the root mean square of those z (about 0),
written with this command to `specdistill/evaluate/bf16_spread.json`, which the check reads.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from specdistill.config import EngineConfig, EvalConfig, TargetConfig
from specdistill.evaluate.bench import load_items
from specdistill.evaluate.engine import BF16_SPREAD_FILE, engine_evaluation, tau_of, tau_z
from specdistill.export import export_eagle3
from specdistill.export.reader import read_head
from specdistill.heads.checkpoint import load_head
from specdistill.io import write_json
from specdistill.layout import trained_head_dir
from specdistill.target import load_target, served_dir

ROOT = Path(__file__).resolve().parents[1]
ENGINE_CHECK_ROWS = 20  # the prompts tests/test_engine.py trains its head on, in conf/exp/engine_check.yaml's steps
STANDARD_DEVIATIONS = 3  # a correct export beyond 3 x the measured spread: rarer than 1 in 300 if z is normal


def engine_check_steps() -> int:
    return OmegaConf.load(ROOT / "conf" / "exp" / "engine_check.yaml").train.max_steps


def summed(counters: list[dict]) -> dict:
    return {"drafts": sum(c["drafts"] for c in counters), "accepted": sum(c["accepted"] for c in counters),
            "accepted_per_pos": [sum(col) for col in zip(*(c["accepted_per_pos"] for c in counters))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--out", type=Path, default=Path("runs/bf16_spread"))
    parser.add_argument("--result", type=Path, default=BF16_SPREAD_FILE,
                        help="where the spread goes (the check reads the default; elsewhere, to compare first)")
    args = parser.parse_args()
    # the head the engine tests serve, learnt from as many prompts as the sets hold (and their test-split rows),
    # trained as many epochs over them
    rows = args.sets * args.prompts * 5 // 4
    prompts = args.out / "prompts.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text("".join(json.dumps({"turns": turns[:1]}) + "\n" for turns in load_items("spec_bench")[:rows]))
    subprocess.run([sys.executable, "train.py", "+exp=engine_check", f"run_root={args.out}", f"data.path={prompts}",
                    f"eval.bench={prompts}", f"train.max_steps={engine_check_steps() * rows // ENGINE_CHECK_ROWS}",
                    "data.generation.batch_size=64"], cwd=ROOT, check=True)
    target_cfg = TargetConfig()
    export = export_eagle3(load_head(trained_head_dir(args.out / "engine_check" / "ckpt")), "vllm",
                           args.out / "export", "bfloat16", str(served_dir(target_cfg)))
    head = read_head(export)  # what the engine reads
    report = engine_evaluation(EngineConfig(name="vllm", dtype="bfloat16"),
                               EvalConfig(bench=str(prompts), limit=args.sets * args.prompts,
                                          max_new_tokens=args.max_new_tokens),
                               load_target(target_cfg), head, {"vllm": export}, served_dir(target_cfg), args.out)
    served, ours = report["layouts"]["vllm"]["per_prompt"], report["ours"]["per_prompt"]
    z = []
    for s in range(args.sets):
        chunk = slice(s * args.prompts, (s + 1) * args.prompts)
        z.append(tau_z(summed(served[chunk]), summed(ours[chunk])))
    rms = (sum(v * v for v in z) / len(z)) ** 0.5
    # each prompt's pair (engine, ours), so a paired statistic can be sized from this run without serving again
    pairs = [[tau_of(e), tau_of(o), e["drafts"], o["drafts"]] for e, o in zip(served, ours)]
    differences = [e - o for e, o, *_ in pairs]
    command = ["python", "scripts/bf16_spread.py", "--sets", str(args.sets), "--prompts", str(args.prompts),
               "--max-new-tokens", str(args.max_new_tokens)]  # where it ran (--out) is no part of the measurement
    result = {"command": shlex.join(command),
              "engine": f"{report['engine']} {report['version']}", "sets": args.sets,
              "prompts_per_set": args.prompts, "max_new_tokens": args.max_new_tokens, "z": [round(v, 3) for v in z],
              "z_rms": round(rms, 3), "z_limit": round(STANDARD_DEVIATIONS * rms, 3),
              "tau_engine": report["layouts"]["vllm"]["tau"], "tau_ours": report["ours"]["tau"],
              "paired": {"mean_tau_difference": round(statistics.fmean(differences), 4),
                         "sd_tau_difference": round(statistics.stdev(differences), 4)},
              "per_prompt": [[round(e, 4), round(o, 4), de, do] for e, o, de, do in pairs]}
    write_json(args.result, result)
    print(json.dumps(result, indent=1))
    print(f"bfloat16 z over {args.sets} sets of {args.prompts} prompts: rms {rms:.3f}, bound {result['z_limit']} "
          f"(written to {args.result})")


if __name__ == "__main__":
    main()
