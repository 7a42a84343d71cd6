"""The pipeline's export stage: the best (else final) head checkpoint -> one directory per format."""

from __future__ import annotations

import logging
from pathlib import Path

from specdistill.config import EMBEDDED_TARGET, RANDOM_TARGET, RunConfig
from specdistill.export import EAGLE3_LAYOUTS, MTP_LAYOUTS, common, export_eagle3, export_mtp
from specdistill.heads import load_head, trained_head_dir

log = logging.getLogger(__name__)
SERVED_NAMES = {EMBEDDED_TARGET: "HuggingFaceTB/SmolLM2-135M-Instruct", RANDOM_TARGET: None}  # engines' names


def export_checkpoint(ckpt: str | Path, formats: list[str], out: str | Path, dtype: str = "bfloat16",
                      target: str | None = None) -> dict[str, str]:
    """Write the head in `ckpt` in every format, each into `<out>/<format>/`; returns format -> path."""
    head = load_head(ckpt)
    layouts = MTP_LAYOUTS if head.config.kind == "mtp" else EAGLE3_LAYOUTS
    unfit = [fmt for fmt in formats if fmt not in layouts]
    if unfit:  # checked for all formats before any is written
        raise common.ExportError(f"export formats {unfit} do not fit the {head.config.kind} head in {ckpt}; "
                                 f"EAGLE-3 layouts: {list(EAGLE3_LAYOUTS)}, MTP layouts: {list(MTP_LAYOUTS)}")
    if layouts is MTP_LAYOUTS:
        paths = {fmt: str(export_mtp(head, fmt, Path(out) / fmt, dtype)) for fmt in formats}
    else:
        paths = {fmt: str(export_eagle3(head, fmt, Path(out) / fmt, dtype, target)) for fmt in formats}
    log.info("exported %s from %s to %s", ", ".join(formats), ckpt, out)
    return paths


def run(cfg: RunConfig, target=None) -> dict:
    """Export stage entry; `target` is unused (every dimension is in the head config)."""
    out = Path(cfg.out) if cfg.out else cfg.run_dir / "export"
    served = SERVED_NAMES.get(cfg.target.name, cfg.target.name)
    paths = export_checkpoint(trained_head_dir(cfg.run_dir), cfg.export.formats, out, cfg.export.dtype, served)
    return {"formats": paths}
