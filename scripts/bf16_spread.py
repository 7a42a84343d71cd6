"""Measure how far a correct export's bfloat16 engine tau strays from our chain replayed along the engine's own
outputs, the spread the engine check's bfloat16 bound is taken from.

    python scripts/bf16_spread.py --sets 16 --prompts 8 --max-new-tokens 80

In bfloat16 the engine's and our decodes part ways by rounding, so the check replays our chain along the engine's
outputs (`forced.chain_along`) and compares the two taus as a ratio. What still moves a count is a draft whose top
two logits bfloat16 cannot keep apart. How far that moves tau is measured here, on a head trained as the engine tests
train theirs (`+exp=engine_check`: the target's answers to the prompts served, here as many as the sets hold, as many
epochs), exported as it is served (vLLM layout, bfloat16) and served one request at a time on `sets` x `prompts`
Spec-Bench dev prompts; each set of `prompts` (the engine check's size in CI) gives one ratio. The bound is 3 x the
root mean square of (ratio - 1) per set, written with this command to `specdistill/evaluate/bf16_spread.json`, which
the check reads and scales to its own number of drafts.
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
from specdistill.evaluate.counters import same_counts, tau_of
from specdistill.evaluate.engine import engine_evaluation
from specdistill.evaluate.forced import BF16_SPREAD_FILE
from specdistill.export import export_eagle3
from specdistill.export.reader import read_head
from specdistill.heads.checkpoint import load_head
from specdistill.io import write_json
from specdistill.layout import trained_head_dir
from specdistill.target import load_target, served_dir

ROOT = Path(__file__).resolve().parents[1]
ENGINE_CHECK_ROWS = 20  # the prompts tests/test_engine.py trains its head on, in conf/exp/engine_check.yaml's steps
STANDARD_DEVIATIONS = 3  # a correct export beyond 3 x the measured spread: rarer than 1 in 300 if the gap is normal


def engine_check_steps() -> int:
    return OmegaConf.load(ROOT / "conf" / "exp" / "engine_check.yaml").train.max_steps


def summed(counters: list[dict]) -> dict:
    return {"drafts": sum(c["drafts"] for c in counters), "accepted": sum(c["accepted"] for c in counters),
            "accepted_per_pos": [sum(col) for col in zip(*(c["accepted_per_pos"] for c in counters))]}


def set_gaps(served: list[dict], replayed: list[dict], prompts: int) -> tuple[list[float], float]:
    """Engine tau / replay tau - 1 for each set of `prompts` consecutive prompts, and the mean drafts per set."""
    sets = [slice(s, s + prompts) for s in range(0, len(served) - prompts + 1, prompts)]
    gaps = [tau_of(summed(served[chunk])) / tau_of(summed(replayed[chunk])) - 1 for chunk in sets]
    return gaps, statistics.fmean(summed(replayed[chunk])["drafts"] for chunk in sets)


def rms_of(values: list[float]) -> float:
    return (sum(v * v for v in values) / len(values)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set")
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
    entry = report["layouts"]["vllm"]
    served, replayed = entry["per_prompt"], entry["replay"]["per_prompt"]
    gaps, drafts = set_gaps(served, replayed, args.prompts)
    rms = rms_of(gaps)
    # the check scales the bound as 1 / sqrt(drafts): rms x sqrt(drafts) at other set sizes shows whether it holds
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64) if 2 * n <= len(served)]
    scaling = {}
    for n in sizes:
        gaps_n, drafts_n = set_gaps(served, replayed, n)
        scaling[n] = round(rms_of(gaps_n) * drafts_n ** 0.5, 4)
    command = ["python", "scripts/bf16_spread.py", "--sets", str(args.sets), "--prompts", str(args.prompts),
               "--max-new-tokens", str(args.max_new_tokens)]  # where it ran (--out) is no part of the measurement
    result = {"command": shlex.join(command),
              "engine": f"{report['engine']} {report['version']}", "sets": args.sets,
              "prompts_per_set": args.prompts, "max_new_tokens": args.max_new_tokens,
              "drafts_per_set": round(drafts),
              "tau_ratio_minus_1": [round(v, 4) for v in gaps], "rms": round(rms, 4),
              "limit": round(STANDARD_DEVIATIONS * rms, 4),
              "tau_engine": entry["tau"], "tau_replay": entry["replay"]["tau"], "tau_ours_free": report["ours"]["tau"],
              "rms_x_sqrt_drafts_by_prompts_per_set": scaling,
              "prompts_with_replay_counts": sum(same_counts(a, b) for a, b in zip(served, replayed)),
              # each prompt's engine and replay counters, to size other statistics without serving again
              "per_prompt": [[e["accepted"], e["drafts"], r["accepted"], r["drafts"]]
                             for e, r in zip(served, replayed)]}
    write_json(args.result, result)
    print(json.dumps(result, indent=1))
    print(f"bfloat16 engine tau / replay - 1 over {args.sets} sets of {args.prompts} prompts: rms {rms:.4f}, bound "
          f"{result['limit']} at {result['drafts_per_set']} drafts (written to {args.result})")


if __name__ == "__main__":
    main()
