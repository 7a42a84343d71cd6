"""Writing an evaluation: report.json and outputs.jsonl (contract in DESIGN.md), the per-depth
acceptance plot, a short markdown summary with the serving advice, and a W&B table when W&B is on."""

from __future__ import annotations

import logging
from pathlib import Path

from specdistill.config import WandbConfig
from specdistill.evaluate.advice import advice_markdown
from specdistill.io import atomic_path, write_json, write_jsonl

log = logging.getLogger(__name__)


def methods(report: dict) -> dict[str, dict]:
    """The head's tree (the report's top level) and every baseline, by name."""
    return {"head tree": report, **{name: m for name, m in report.get("baselines", {}).items()}}


def summary_markdown(r: dict) -> str:
    tree = r["tree"]
    lossless = "not checked (sampling)" if r["lossless_mismatches"] is None else r["lossless_mismatches"]
    lines = [f"# Acceptance on {r['bench']} ({r['num_prompts']} prompts, temperature {r['temperature']}, "
             f"batch {r['batch_size']})", "",
             f"- head: {r['head']} on target {r['target']}",
             f"- tau: **{r['tau']:.2f}** tokens per target forward (tree depth {tree['depth']}, top-k {tree['topk']}, "
             f"{tree['num_draft_tokens']} draft tokens); 95% interval over prompts {interval(r['tau_ci'])}",
             f"- speedup vs plain decoding (same run): **{r['speedup']:.2f}x** ({r['wall_s']:.1f}s vs "
             f"{r['baseline_wall_s']:.1f}s; drafting {r['draft_s']:.1f}s, verification {r['verify_s']:.1f}s)"
             + (f"; {r['resumed_batches']} batches and their times come from a killed earlier sitting"
                if r.get("resumed_batches") else ""),
             f"- outputs differing from plain greedy decoding: {lossless}",
             f"- target output tokens outside the head's draft vocabulary (no head can propose them): "
             f"{r['outside_draft_vocab']:.1%}", "",
             "| drafter | tau (95% interval) | head tau / its tau (95% interval) | tau on copy rounds | tau elsewhere "
             "| speedup | target forwards | acceptance per depth |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in methods(r).items():
        ratio = f"{m['head_ratio']:.2f}x {interval(m['head_ratio_ci'])}" if "head_ratio" in m else "-"
        lines.append(f"| {name} | {m['tau']:.2f} {interval(m['tau_ci'])} | {ratio} | {m['tau_copy']:.2f} "
                     f"| {m['tau_elsewhere']:.2f} | {m['speedup']:.2f}x | {m['target_forwards']} "
                     f"| {_depths(m['accept_per_depth'])} |")
    lines += ["", "Intervals: bootstrap over the prompts, each draw resampling the same prompts for every drafter.",
              "", f"Copy rounds ({r['copy_round_share']:.0%} of the head's rounds) start on a token that completes a "
              "3-gram already in the context: where copying from the context pays most.",
              "", "Acceptance at each depth given the path reached the depth before (copy rounds | the rest): "
              "whether a drafter loses a copy at its first token or deeper in the span.", "",
              "| drafter | copy rounds | elsewhere |", "|---|---|---|"]
    lines += [f"| {name} | {_depths(m['accept_per_depth_conditional_copy'])} "
              f"| {_depths(m['accept_per_depth_conditional_elsewhere'])} |" for name, m in methods(r).items()]
    if r.get("tau_by_category"):
        categories = list(r["tau_by_category"])
        lines += ["", "Per benchmark category (the rows' `category` field): where a drafter wins and where it loses.", "",
                  f"| tau by category | {' | '.join(categories)} |", "|---" * (len(categories) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{m['tau_by_category'][c]:.2f}" for c in categories) + " |"
                  for name, m in methods(r).items()]
    lines += engine_markdown(r["engine"]) if r.get("engine") else []
    text = "\n".join(lines) + "\n"
    return text + ("\n" + advice_markdown(r["serving_advice"]) if r.get("serving_advice") else "")


def engine_markdown(e: dict) -> list[str]:
    """The exported head as the engine served it, beside our chain of the same length (eval/engine.json)."""
    lines = ["", f"## In the engine: {e['engine']} {e['version']} ({e['dtype']}, {e['num_speculative_tokens']} "
             "speculative tokens)", "", "| layout | engine tau | our chain's tau | engine / ours | accepted per position, "
             "engine / ours | prompts counted as ours | outputs equal the engine's plain greedy | finding |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {layout} | failed | {e['ours_chain_tau']:.3f} | - | - | - | - | **{m['finding']}** |"
              if m["tau"] is None else
              f"| {layout} | {m['tau']:.3f} | {e['ours_chain_tau']:.3f} | {m['tau_ratio_to_ours']:.3f}x"
              + (f" ({m['tau_ratio_to_replay']:.3f}x our chain along its outputs)" if m.get("tau_ratio_to_replay")
                 else "") + " "
              f"| {m['accepted_per_pos']} / {e['ours_accepted_per_pos']} "
              f"| {m['prompts_equal_ours']}/{e['num_prompts']} | {m['outputs_equal_plain']} "
              f"| {('**' + m['finding'] + '**') if m['finding'] else m['explained'] or '-'} |"
              for layout, m in e["layouts"].items()]
    return lines


def _depths(shares: list[float]) -> str:
    return " ".join(f"{a:.2f}" for a in shares)


def interval(bounds: list[float]) -> str:
    return f"[{bounds[0]:.2f}, {bounds[1]:.2f}]"


def plot_acceptance(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    entries = methods(report)
    width = 0.8 / len(entries)
    for i, (name, m) in enumerate(entries.items()):
        acc = m["accept_per_depth"]
        ax.bar([d + 1 + (i - (len(entries) - 1) / 2) * width for d in range(len(acc))], acc, width,
               label=f"{name} (tau {m['tau']:.2f})")
    ax.set(xlabel="draft depth", ylabel="share of rounds accepted to this depth", ylim=(0, 1),
           title=f"{report['bench']}: tau {report['tau']:.2f}, speedup {report['speedup']:.2f}x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def log_wandb(report: dict, wandb: WandbConfig, out_dir: Path, name: str) -> None:
    """One table row per drafter, plus the per-batch serving advice."""
    if wandb.mode == "disabled":
        return
    import wandb as wb

    run = wb.init(project=wandb.project, entity=wandb.entity, mode=wandb.mode, dir=str(out_dir), name=name,
                  job_type="eval", reinit="finish_previous")
    depths = ["accept_per_depth", "accept_per_depth_conditional_copy", "accept_per_depth_conditional_elsewhere"]
    columns = ["drafter", "tau", "tau_ci", "head_ratio", "head_ratio_ci", "tau_copy", "tau_elsewhere", "speedup",
               "target_forwards", "new_tokens", *depths, "tau_by_category"]
    table = wb.Table(columns=columns)
    for drafter, m in methods(report).items():
        table.add_data(drafter, m["tau"], str(m["tau_ci"]), m.get("head_ratio"), str(m.get("head_ratio_ci")),
                       m["tau_copy"], m["tau_elsewhere"], m["speedup"], m["target_forwards"],
                       m["new_tokens"], *(str([round(a, 3) for a in m[key]]) for key in depths),
                       str({c: round(t, 3) for c, t in m["tau_by_category"].items()}))
    logged = {"eval/acceptance": table, "eval/tau": report["tau"], "eval/speedup": report["speedup"]}
    if report.get("serving_advice"):
        rows = report["serving_advice"]["per_batch"]
        advice = wb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
        logged["eval/serving_advice"] = advice
    run.log(logged)
    run.finish()


def write_report(report: dict, rows: list[dict], out_dir: Path, wandb: WandbConfig) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "outputs.jsonl", rows)
    write_json(out_dir / "report.json", report)
    plot_acceptance(report, out_dir / "acceptance.png")
    with atomic_path(out_dir / "summary.md") as tmp:
        tmp.write_text(summary_markdown(report))
    log_wandb(report, wandb, out_dir, f"eval-{report['bench']}")
    log.info("wrote report.json, outputs.jsonl, acceptance.png and summary.md to %s", out_dir)
