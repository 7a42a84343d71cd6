"""The evaluate stage: real tau, per-depth acceptance, speedup and a lossless check on the real target.

Every prompt is decoded twice in the same run: plain greedy (the baseline and the reference) and
speculative with the head's dynamic tree. Writes `eval/report.json`, `eval/outputs.jsonl`,
`eval/acceptance.png` and `eval/summary.md` (contract in DESIGN.md).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill.config import RunConfig
from specdistill.evaluate.bench import load_prompts
from specdistill.heads import load_head
from specdistill.io import write_json, write_jsonl
from specdistill.spec.decode import Drafter, greedy_generate, speculative_generate
from specdistill.target import Target, TargetRunner

log = logging.getLogger(__name__)


def head_dir(run_dir: Path) -> Path:
    best = run_dir / "ckpt" / "best"
    return best if best.exists() else run_dir / "ckpt" / "final"


def per_depth(accepted: list[int], depth: int) -> list[float]:
    """Share of verification rounds whose accepted path reached depth d, for d = 1..depth."""
    rounds = max(1, len(accepted))
    return [sum(a >= d for a in accepted) / rounds for d in range(1, depth + 1)]


def evaluate(cfg: RunConfig, target: Target, head, out_dir: Path) -> dict:
    eos = target.eos_ids
    prompts = load_prompts(cfg.eval.bench, cfg.eval.limit)
    runner = TargetRunner(target)
    drafter = Drafter(head.to(dtype=torch.float32).eval(), target.vocab_size)
    tree = cfg.eval.tree
    rows, accepted, forwards, spec_s, base_s, draft_s, mismatches = [], [], 0, 0.0, 0.0, 0.0, 0
    for text in tqdm(prompts, desc="evaluate"):
        ids = target.prompt_ids(text)
        t0 = time.perf_counter()
        reference = greedy_generate(target.model, ids, cfg.eval.max_new_tokens, eos)
        base_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = speculative_generate(runner, drafter, ids, cfg.eval.max_new_tokens, tree.depth, tree.topk,
                                     tree.num_draft_tokens, eos)
        spec_s += time.perf_counter() - t0
        draft_s += stats.draft_s
        forwards += stats.target_forwards
        accepted += stats.accepted
        mismatches += int(stats.tokens != reference)
        rows.append({"prompt": text, "prompt_ids": ids, "output_ids": stats.tokens,
                     "accepted_per_round": stats.accepted, "matches_greedy": stats.tokens == reference})
    new_tokens = sum(len(r["output_ids"]) for r in rows)
    report = {
        "tau": sum(a + 1 for a in accepted) / max(1, len(accepted)),
        "accept_per_depth": per_depth(accepted, tree.depth),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "wall_s": round(spec_s, 3),
        "baseline_wall_s": round(base_s, 3),
        "speedup": base_s / spec_s if spec_s else 0.0,
        "draft_s": round(draft_s, 3),
        "verify_s": round(spec_s - draft_s, 3),
        "lossless_mismatches": mismatches,
        "tree": {"depth": tree.depth, "topk": tree.topk, "num_draft_tokens": tree.num_draft_tokens},
        "temperature": cfg.eval.temperature,
        "num_prompts": len(prompts),
        "bench": cfg.eval.bench,
        "target": target.name,
    }
    write_jsonl(out_dir / "outputs.jsonl", rows)
    write_json(out_dir / "report.json", report)
    plot_acceptance(report, out_dir / "acceptance.png")
    (out_dir / "summary.md").write_text(summary_markdown(report))
    return report


def summary_markdown(r: dict) -> str:
    depths = " | ".join(f"{a:.2f}" for a in r["accept_per_depth"])
    return (f"# Acceptance on {r['bench']} ({r['num_prompts']} prompts, temperature {r['temperature']})\n\n"
            f"- tau: **{r['tau']:.2f}** tokens per target forward\n"
            f"- speedup vs plain greedy decoding (same run): **{r['speedup']:.2f}x** "
            f"({r['wall_s']:.1f}s vs {r['baseline_wall_s']:.1f}s; drafting {r['draft_s']:.1f}s)\n"
            f"- lossless mismatches: {r['lossless_mismatches']}\n"
            f"- tree: {r['tree']}\n- share of rounds reaching depth 1..{len(r['accept_per_depth'])}: {depths}\n")


def plot_acceptance(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = report["accept_per_depth"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(1, len(acc) + 1), acc)
    ax.set(xlabel="draft depth", ylabel="share of rounds accepted to this depth", ylim=(0, 1),
           title=f"tau {report['tau']:.2f}, speedup {report['speedup']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: RunConfig, target) -> dict:
    out_dir = Path(cfg.out) if cfg.out else cfg.run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    head = load_head(head_dir(cfg.run_dir))
    report = evaluate(cfg, target.get(), head, out_dir)
    log.info("tau %.2f, speedup %.2fx, lossless mismatches %d; report in %s", report["tau"], report["speedup"],
             report["lossless_mismatches"], out_dir / "report.json")
    return {"report": str(out_dir / "report.json"), **{k: report[k] for k in ("tau", "speedup", "lossless_mismatches")}}
