"""train/curves.png: what a person looks at to see whether training went well."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specdistill.io import atomic_path


def moving_average(values: list[float], window: int) -> np.ndarray:
    """Mean of each value and the `window - 1` before it (fewer at the start): per-step training metrics
    swing with each batch's mix of documents, so only their trend is readable."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def plot_history(history: list[dict], path: Path) -> None:
    """train/curves.png: loss and per-step accuracy (a moving average over about a fiftieth of the run,
    the raw values faint behind), and the held-out accuracy at each checkpoint."""
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    window = max(1, len(history) // 50)
    depths = range(len([k for k in history[0] if k.startswith("acc/")]))
    fig, (ax_loss, ax_acc, ax_held) = plt.subplots(1, 3, figsize=(16, 4))
    for ax, key, label in [(ax_loss, "loss", "loss")] + [(ax_acc, f"acc/{j}", f"step {j}") for j in depths]:
        raw = [h[key] for h in history]
        line, = ax.plot(steps, moving_average(raw, window), label=label)
        ax.plot(steps, raw, color=line.get_color(), alpha=0.12, linewidth=0.5)
    ax_loss.set(xlabel="step", ylabel="weighted TTT loss", title=f"training loss (mean of {window} steps)")
    ax_acc.set(xlabel="step", ylabel="top-1 agreement with target",
               title=f"accuracy per TTT step (mean of {window} steps)")
    ax_acc.legend(fontsize=7, loc="lower right")
    held = [h for h in history if "holdout/copy_acc0" in h]
    for j in depths:
        line, = ax_held.plot([h["step"] for h in held], [h[f"holdout/acc{j}"] for h in held], label=f"step {j}")
        ax_held.plot([h["step"] for h in held], [h[f"holdout/copy_acc{j}"] for h in held], "--", color=line.get_color())
    ax_held.set(xlabel="step", ylabel="top-1 agreement with target",
                title="held out: all tokens (solid), tokens in the context (dashed)")
    ax_held.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
