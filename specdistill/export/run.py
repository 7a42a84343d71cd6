"""The pipeline's export stage: the best (else final) head checkpoint -> one directory per format."""

from __future__ import annotations

import logging
from pathlib import Path

from specdistill.config import EMBEDDED_TARGET, RANDOM_TARGET, RunConfig
from specdistill.export import (
    EAGLE3_LAYOUTS,
    MTP_LAYOUTS,
    common,
    dflash,
    export_dflash,
    export_eagle3,
    export_mtp,
    fitting_formats,
)
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
        formats = fitting_formats(head)
        if not formats:
            log.warning("no engine serves the %s head in %s (an MTP head on a target without its own MTP layers); "
                        "nothing exported", kind, ckpt)
            return {}
    layouts = {"eagle3": EAGLE3_LAYOUTS, "dflash": dflash.LAYOUTS}.get(kind, MTP_LAYOUTS)
    unfit = [fmt for fmt in formats if fmt not in layouts]
    if unfit:  # checked for all formats before any is written
        raise common.ExportError(f"export formats {unfit} do not fit the {kind} head in {ckpt}; EAGLE-3 layouts: "
                                 f"{list(EAGLE3_LAYOUTS)}, DFlash layouts: {list(dflash.LAYOUTS)}, MTP layouts: "
                                 f"{list(MTP_LAYOUTS)}")
    if layouts is MTP_LAYOUTS:
        paths = {fmt: str(export_mtp(head, Path(out) / fmt, dtype, checkpoint)) for fmt in formats}
    else:
        write = export_dflash if kind == "dflash" else export_eagle3
        paths = {fmt: str(write(head, fmt, Path(out) / fmt, dtype, target, speculative_tokens=speculative_tokens))
                 for fmt in formats}
    log.info("exported %s from %s to %s", ", ".join(formats), ckpt, out)
    return paths


def run(cfg: RunConfig, layout: RunLayout, advised_tokens: int | None = None) -> dict:
    """Export stage entry. The chain the speculators layout names is `export.speculative_tokens` when set, else
    `advised_tokens` (the evaluation's advice, which the pipeline hands over), else 3. The verifier is the target's
    HF name (the random target: its saved folder). The target's own folder (a local dir, its HF cache entry, the
    saved random target) is the checkpoint whose stale MTP layer a native MTP export replaces; the embedded GGUF
    target has none."""
    checkpoint = None if cfg.target.name == EMBEDDED_TARGET or cfg.target.gguf_file else served_dir(cfg.target)
    served = str(checkpoint) if cfg.target.name == RANDOM_TARGET else SERVED_NAMES.get(cfg.target.name, cfg.target.name)
    steps = cfg.export.speculative_tokens or advised_tokens or DEFAULT_SPECULATIVE_TOKENS
    paths = export_checkpoint(layout.trained_head_dir(), cfg.export.formats, layout.export_dir, cfg.export.dtype,
                              served, steps, checkpoint)
    return {"formats": paths}
