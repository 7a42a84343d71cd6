"""Qwen3-Next / Qwen3.5 MTP layout: one module under `mtp.*` beside the target's weights.

Loaders: vLLM `vllm/model_executor/models/qwen3_next_mtp.py` (`Qwen3NextMTP`) and SGLang
`python/sglang/srt/models/qwen3_next_mtp.py` read `mtp.fc` (our `eh_proj`, over
cat(embedding, hidden) in that order), `mtp.pre_fc_norm_embedding` (our `enorm`),
`mtp.pre_fc_norm_hidden` (our `hnorm`), `mtp.layers.0.*` (the block) and `mtp.norm`, with
`num_nextn_predict_layers: 1` in the target's config. The MTP module shares the target's
`model.embed_tokens` and `lm_head`, so ours are not written (mapped to None below): this layout fits
only a head trained with the target's frozen embedding and lm_head. Qwen3-Next blocks also carry
q/k norms and a gated q_proj that a Llama-family block lacks; no engine loads this layout for a
Llama-family target today.

Output: `mtp.safetensors`, config.json (the target's when given, plus `num_nextn_predict_layers`),
and given the target's index, a copy with the `mtp.*` keys added.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specdistill.export import common

NAME = "qwen3_next_mtp"
WEIGHTS_FILE = "mtp.safetensors"
KEY_MAP: dict[str, str | None] = {
    "embed_tokens.weight": None,  # the target's model.embed_tokens is used
    "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "eh_proj.weight": "mtp.fc.weight",
    **{f"layers.0.{k}": f"mtp.layers.0.{k}" for k in common.BLOCK_KEYS},
    "norm.weight": "mtp.norm.weight",
    "lm_head.weight": None,  # the target's lm_head is used
}
REQUIRED_KEYS = tuple(v for v in KEY_MAP.values() if v is not None)


def convert(modules: Sequence[Mapping[str, torch.Tensor]], dims: common.MTPDims, dtype: str = "bfloat16",
            target_config: Mapping | None = None, target_index: Mapping | None = None) -> common.Converted:
    """Validated Qwen3-Next-style MTP tensors, config.json and (optionally) the stitched index."""
    common.check_mtp(modules, dims, f"{NAME} export", full_vocab_head=False)
    if len(modules) != 1:
        raise common.ExportError(f"{NAME} export: {len(modules)} MTP modules given; this layout holds exactly one "
                                 "(`mtp.fc` and the norms are shared by every MTP step)")
    tensors = common.rename(common.cast(modules[0], dtype), KEY_MAP)
    if target_config is not None:
        common.check_target_dims(target_config, common.mtp_target_dims(dims), f"{NAME} export")
        config = dict(target_config)
    else:
        config = common.llama_fields(dims.arch, dims.vocab_size) | {"num_hidden_layers": dims.target_num_layers}
    config["num_nextn_predict_layers"] = 1
    extra = {}
    if target_index is not None:
        extra[common.INDEX_FILE] = common.stitched_index(target_index, WEIGHTS_FILE, sorted(tensors))
    return common.Converted(tensors, config, WEIGHTS_FILE, extra)
