"""Print the headline table (head against prompt lookup) from evaluation reports, so no figure is typed by hand.

    python scripts/results_table.py runs/d5k15t/eval_test runs/d5k15t/eval

Each argument is an evaluation directory (or its report.json); its row names the run, the split and the rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdistill.evaluate.report import interval

LOOKUP = "prompt_lookup"
HEADER = ("| run | split, prompts | head tau | prompt lookup tau | head / lookup | lossless mismatches |\n"
          "|---|---|---|---|---|---|")


def row(report_path: Path) -> str:
    """One markdown row; refuses a report without the prompt-lookup baseline, which the table compares against."""
    report = json.loads(report_path.read_text())
    lookup = report.get("baselines", {}).get(LOOKUP)
    if lookup is None:
        raise SystemExit(f"{report_path}: no `{LOOKUP}` baseline (evaluate with eval.baselines=[{LOOKUP}])")
    run = Path(report["head"]).parts
    run_name = run[run.index("ckpt") - 1] if "ckpt" in run else report["head"]
    return (f"| `{run_name}` | {report['split']}, {report['num_prompts']} | {report['tau']:.2f} {interval(report['tau_ci'])} | "
            f"{lookup['tau']:.2f} {interval(lookup['tau_ci'])} | {lookup['head_ratio']:.2f}x {interval(lookup['head_ratio_ci'])} | "
            f"{report['lossless_mismatches']} |")


def main(paths: list[str]) -> None:
    if not paths:
        raise SystemExit(__doc__)
    reports = [Path(p) / "report.json" if Path(p).is_dir() else Path(p) for p in paths]
    print("\n".join([HEADER, *(row(p) for p in reports)]))


if __name__ == "__main__":
    main(sys.argv[1:])
