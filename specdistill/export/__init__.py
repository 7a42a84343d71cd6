"""Export trained heads to the layouts serving engines load: one module per layout, one reader.

EAGLE-3: `sglang`, `vllm`, `speculators`, `trtllm`, each with a `KEY_MAP`, `REQUIRED_KEYS` and a pure `convert`
that validates before anything is written. A target's own MTP module: `native_mtp` (its checkpoint's keys). DFlash:
`dflash.LAYOUTS` (vllm, speculators), one module for both.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from specdistill.export import common, dflash, native_mtp, sglang, speculators, trtllm, vllm
from specdistill.heads.base import drafts_in_parallel

log = logging.getLogger(__name__)

EAGLE3_LAYOUTS = {"sglang": sglang, "vllm": vllm, "speculators": speculators, "trtllm": trtllm}
MTP_LAYOUTS = {"native_mtp": native_mtp}
FITTING_FORMATS = {"eagle3": ["sglang", "vllm"], "native_mtp": ["native_mtp"], "mtp": [],  # export.formats: null
                   "dflash": list(dflash.LAYOUTS)}
# P-EAGLE: vLLM serves it (`parallel_drafting`); SGLang's and TensorRT-LLM's docs define no layout for it
PARALLEL_LAYOUTS = ["vllm", "speculators"]


def fitting_formats(head) -> list[str]:
    """The layouts `export.formats: null` writes for this head."""
    kind = head.config.kind
    return PARALLEL_LAYOUTS if kind == "eagle3" and drafts_in_parallel(head) else FITTING_FORMATS[kind]


def export_eagle3(head, fmt: str, out_dir: str | Path, dtype: str = "bfloat16", target: str | None = None,
                  target_config: Mapping | None = None, speculative_tokens: int = 3) -> Path:
    """Write an `Eagle3Head` in layout `fmt` to `out_dir` (replaced whole); `target` names the verifier, and
    `speculative_tokens` the chain an engine drafts by default (where the layout records one)."""
    if fmt not in EAGLE3_LAYOUTS:
        raise common.ExportError(f"export format {fmt!r} does not fit an EAGLE-3 head; "
                                 f"expected one of {list(EAGLE3_LAYOUTS)}")
    if head.config.parallel_drafting and fmt not in PARALLEL_LAYOUTS:
        raise common.ExportError(f"export format {fmt!r} does not fit a P-EAGLE head: its engine's docs define no "
                                 f"parallel-drafting layout; expected one of {PARALLEL_LAYOUTS}")
    if target_config is not None:
        common.check_target_dims(target_config, common.eagle3_target_dims(head.config), f"{fmt} export")
    state = {k: v.detach().cpu() for k, v in head.trainable_state_dict().items()}
    converted = EAGLE3_LAYOUTS[fmt].convert(state, head.config, dtype, target, speculative_tokens)
    out = common.write_export(out_dir, converted)
    log.info("exported %s head (%s) to %s", fmt, dtype, out)
    return out


def export_dflash(head, fmt: str, out_dir: str | Path, dtype: str = "bfloat16", target: str | None = None,
                  target_config: Mapping | None = None, speculative_tokens: int = 3) -> Path:
    """Write a `DFlashHead` in layout `fmt` (`dflash.LAYOUTS`) to `out_dir` (replaced whole)."""
    if target_config is not None:
        common.check_target_dims(target_config, common.eagle3_target_dims(head.config), f"{fmt} export")
    state = {k: v.detach().cpu() for k, v in head.trainable_state_dict().items()}
    out = common.write_export(out_dir, dflash.convert(state, head.config, fmt, dtype, target, speculative_tokens))
    log.info("exported %s DFlash head (%s) to %s", fmt, dtype, out)
    return out


def export_mtp(head, out_dir: str | Path, dtype: str = "bfloat16", checkpoint: str | Path | None = None) -> Path:
    """Write a target's own MTP module in its checkpoint's keys; given `checkpoint` (the target's dir), also the
    re-pointed index and the target's shards without their stale MTP layer."""
    converted = native_mtp.convert(head, dtype, checkpoint)
    out = common.write_export(out_dir, converted)
    log.info("exported the MTP module (%s) to %s%s", dtype, out,
             f" (shards rewritten without the stale MTP layer: {', '.join(converted.extra_tensors)})"
             if converted.extra_tensors else "")
    return out
