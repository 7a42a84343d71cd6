"""The export -> engine check on a tiny random target of each family users serve: the smoke pipeline with
`target.random.family=<family>` and `eval.engine.name=vllm`, then one table of what the engine measured.

    python scripts/engine_families.py                        # every family, into engine_families/
    python scripts/engine_families.py families=[qwen3,phi3] out=families

A family the engine cannot serve gets its first error line in the table instead of numbers.
"""

import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

from specdistill.io import write_table
from specdistill.target import RANDOM_FAMILIES

ROOT = Path(__file__).resolve().parents[1]
ERROR_WORDS = ("Error", "error:", "Unsupported", "not supported", "FINDING")


def first_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if any(w in line for w in ERROR_WORDS)]
    lines = [line for line in lines if "not support" in line][:1] or lines  # the engine's reason, if it gives one
    return (lines[-1] if lines else text.strip().splitlines()[-1] if text.strip() else "no output")[:200]


def check(family: str, out: Path) -> str:
    """One family through the smoke pipeline and the engine; its table row."""
    overrides = ["+exp=smoke", f"name={family}", f"run_root={out}", f"target.random.family={family}",
                 "stages=[prepare,capture,train,evaluate]", "eval.engine.name=vllm"]
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, capture_output=True,
                          text=True)
    (out / f"{family}.log").write_text(proc.stdout + proc.stderr)
    report = out / family / "eval" / "engine.json"
    if proc.returncode != 0 or not report.exists():
        return f"| {family} | - | - | - | - | {first_error(proc.stdout + proc.stderr)} |"
    r = json.loads(report.read_text())
    layouts = r["layouts"]
    failed = [first_error((report.parent / "engine" / f"{name}.log").read_text(errors="replace"))
              for name, m in layouts.items() if m.get("failed")]
    cells = ["failed" if m.get("failed") else f"{m['tau']:.3f} ({'equal' if m['counters_equal_ours'] else 'differ'})"
             for m in layouts.values()]
    lossless = " / ".join("-" if m.get("failed") else f"{m['outputs_equal_plain']}/{r['num_prompts']}"
                          for m in layouts.values())
    warned = any(m.get("weight_warnings") for m in layouts.values())
    return (f"| {family} | {r['ours']['tau']:.3f} | {' / '.join(cells)} | {lossless} | "
            f"{'some' if warned else 'none'} | {failed[0] if failed else 'ok'} |")


def main() -> None:
    args = OmegaConf.from_cli()
    families = list(args.get("families", RANDOM_FAMILIES))
    out = Path(args.get("out", "engine_families")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = ["| family | our chain tau | vLLM tau, vllm / speculators layout (counters vs ours) | outputs equal plain "
            "| weight warnings | result |", "|---|---|---|---|---|---|"]
    rows += [check(family, out) for family in tqdm(families, desc="families", unit="family")]
    write_table(out / "families.md", rows)
    print(f"each family's log: {out}/<family>.log")


if __name__ == "__main__":
    main()
