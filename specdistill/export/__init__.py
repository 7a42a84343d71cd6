"""Export trained heads to the layouts serving engines load: one module per layout, one reader.

EAGLE-3: `sglang`, `vllm`, `speculators`, `trtllm`. MTP: `deepseek_mtp`, `qwen3_next_mtp`. Each module
has a `KEY_MAP`, `REQUIRED_KEYS` and a pure `convert` that validates before anything is written.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from specdistill.export import common, deepseek_mtp, qwen3_next_mtp, sglang, speculators, trtllm, vllm

log = logging.getLogger(__name__)

EAGLE3_LAYOUTS = {"sglang": sglang, "vllm": vllm, "speculators": speculators, "trtllm": trtllm}
MTP_LAYOUTS = {"deepseek_mtp": deepseek_mtp, "qwen3_next_mtp": qwen3_next_mtp}


def export_eagle3(head, fmt: str, out_dir: str | Path, dtype: str = "bfloat16", target: str | None = None,
                  target_config: Mapping | None = None, speculative_tokens: int = 3) -> Path:
    """Write an `Eagle3Head` in layout `fmt` to `out_dir` (replaced whole); `target` names the verifier, and
    `speculative_tokens` the chain an engine drafts by default (where the layout records one)."""
    if fmt not in EAGLE3_LAYOUTS:
        raise common.ExportError(f"export format {fmt!r} does not fit an EAGLE-3 head; "
                                 f"expected one of {list(EAGLE3_LAYOUTS)}")
    if target_config is not None:
        common.check_target_dims(target_config, common.eagle3_target_dims(head.config), f"{fmt} export")
    state = {k: v.detach().cpu() for k, v in head.trainable_state_dict().items()}
    converted = EAGLE3_LAYOUTS[fmt].convert(state, head.config, dtype, target, speculative_tokens)
    out = common.write_export(out_dir, converted)
    log.info("exported %s head (%s) to %s", fmt, dtype, out)
    return out


def export_mtp(head, fmt: str, out_dir: str | Path, dtype: str = "bfloat16", target_config: Mapping | None = None,
               target_index: Mapping | None = None) -> Path:
    """Write an MTP head (anything with `module_state_dicts()` and an MTP config) in layout `fmt`."""
    if fmt not in MTP_LAYOUTS:
        raise common.ExportError(f"export format {fmt!r} does not fit an MTP head; expected one of {list(MTP_LAYOUTS)}")
    modules = [{k: v.detach().cpu() for k, v in m.items()} for m in head.module_state_dicts()]
    converted = MTP_LAYOUTS[fmt].convert(modules, head.config, dtype, target_config, target_index)
    out = common.write_export(out_dir, converted)
    log.info("exported %s head (%s) to %s", fmt, dtype, out)
    return out
