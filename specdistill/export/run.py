"""The pipeline's export stage: the best (else final) head checkpoint -> one directory per format."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specdistill.config import EMBEDDED_TARGET, RANDOM_TARGET, RunConfig
from specdistill.export import EAGLE3_LAYOUTS, FITTING_FORMATS, MTP_LAYOUTS, common, export_eagle3, export_mtp
from specdistill.heads.checkpoint import load_head
from specdistill.layout import RunLayout
from specdistill.target import served_dir

log = logging.getLogger(__name__)
SERVED_NAMES = {EMBEDDED_TARGET: "HuggingFaceTB/SmolLM2-135M-Instruct"}  # the engines' name of a target
DEFAULT_SPECULATIVE_TOKENS = 3


def export_checkpoint(ckpt: str | Path, formats: list[str] | None, out: str | Path, dtype: str = "bfloat16",
                      target: str | None = None, speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
                      checkpoint: str | Path | None = None) -> dict[str, str]:
    """Write the head in `ckpt` in every format (None: those that fit it), each into `<out>/<format>/`; returns
    format -> path. `target` names the verifier (speculators layout), `speculative_tokens` the chain vLLM drafts by
    default there; `checkpoint` is the target's dir, whose stale MTP layer a native MTP export replaces."""
    head = load_head(ckpt)
    kind = head.config.kind
    if formats is None:
        formats = FITTING_FORMATS[kind]
        if not formats:
            log.warning("no engine serves the %s head in %s (an MTP head on a target without its own MTP layers); "
                        "nothing exported", kind, ckpt)
            return {}
    layouts = EAGLE3_LAYOUTS if kind == "eagle3" else MTP_LAYOUTS
    unfit = [fmt for fmt in formats if fmt not in layouts]
    if unfit:  # checked for all formats before any is written
        raise common.ExportError(f"export formats {unfit} do not fit the {kind} head in {ckpt}; "
                                 f"EAGLE-3 layouts: {list(EAGLE3_LAYOUTS)}, MTP layouts: {list(MTP_LAYOUTS)}")
    if layouts is MTP_LAYOUTS:
        paths = {fmt: str(export_mtp(head, Path(out) / fmt, dtype, checkpoint)) for fmt in formats}
    else:
        paths = {fmt: str(export_eagle3(head, fmt, Path(out) / fmt, dtype, target, speculative_tokens=speculative_tokens))
                 for fmt in formats}
    log.info("exported %s from %s to %s", ", ".join(formats), ckpt, out)
    return paths


def advised_speculative_tokens(report: Path) -> int:
    """The chain the run's evaluation on the dev split advises for vLLM at its smallest batch, else the default:
    a default chosen on the test split would no longer leave the test split untouched."""
    saved = json.loads(report.read_text()) if report.exists() else {}
    if saved and saved.get("split") != "dev":
        log.info("%s is an evaluation on the %s split: its serving advice is not read; %d speculative tokens",
                 report, saved.get("split"), DEFAULT_SPECULATIVE_TOKENS)
        return DEFAULT_SPECULATIVE_TOKENS
    advice = saved.get("serving_advice")
    steps = advice["per_batch"][0]["vllm_steps"] if advice and advice.get("per_batch") else 0
    return steps if steps >= 1 else DEFAULT_SPECULATIVE_TOKENS


def run(cfg: RunConfig, layout: RunLayout, target=None) -> dict:
    """Export stage entry; `target` is unused (every dimension is in the head config). The verifier is the target's
    HF name (the random target: its saved folder). The target's own folder (a local dir, its HF cache entry, the
    saved random target) is the checkpoint whose stale MTP layer a native MTP export replaces; the embedded GGUF
    target has none."""
    checkpoint = None if cfg.target.name == EMBEDDED_TARGET or cfg.target.gguf_file else served_dir(cfg.target)
    served = str(checkpoint) if cfg.target.name == RANDOM_TARGET else SERVED_NAMES.get(cfg.target.name, cfg.target.name)
    steps = cfg.export.speculative_tokens or advised_speculative_tokens(layout.report_file)
    paths = export_checkpoint(layout.trained_head_dir(), cfg.export.formats, layout.export_dir, cfg.export.dtype,
                              served, steps, checkpoint)
    return {"formats": paths}
