"""The few lines `train.py` prints at the end: what was measured and where everything went."""

from __future__ import annotations

from specdistill.config import RunConfig
from specdistill.layout import RunLayout


def print_summary(cfg: RunConfig, results: dict[str, dict]) -> None:
    lines = [f"specdistill run `{cfg.name}` done: {RunLayout.of(cfg).run_dir}"]
    for stage, res in results.items():
        lines.append(f"  {stage:<9} {res.get('seconds', 0):>7.1f}s")
    if "train" in results:
        t = results["train"]
        lines.append(f"  head: {t['head']} (steps {t['steps']})")
        if t.get("holdout/acc0") is not None:
            lines.append(f"  held-out conversations: the head's first choice is the target's token "
                         f"{t['holdout/acc0']:.0%} of the time (simulated chain tau {t['holdout/tau_sim']:.2f})")
        if t.get("loop_tau") is not None:
            lines.append(f"  in-loop tau on benchmark rows outside the evaluated slice: {t['loop_tau']:.2f}")
        if t.get("best"):
            lines.append(f"  best head (evaluated and exported): {t['best']} (step {t['best_step']})")
    if "evaluate" in results:
        e = results["evaluate"]
        lines.append(f"  tau {e['tau']:.2f}, speedup {e['speedup']:.2f}x vs plain greedy, "
                     f"lossless mismatches {e['lossless_mismatches']}")
        if e.get("engine"):
            lines.append(f"  engine: {e['engine']['line']}")
        lines.append(f"  report: {e['report']}")
    if "export" in results:
        for fmt, path in results["export"].get("formats", {}).items():
            lines.append(f"  export {fmt}: {path}")
    print("\n".join(lines))
