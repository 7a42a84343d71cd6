"""DeepSeek-V3 MTP layout: module k of the head becomes decoder layer L+k of the target checkpoint.

Loaders: vLLM `vllm/model_executor/models/deepseek_mtp.py` (`DeepSeekMTP`) and SGLang
`python/sglang/srt/models/deepseek_nextn.py` read `model.layers.{L+k}.{enorm,hnorm,eh_proj,
shared_head.norm,shared_head.head,embed_tokens}` plus the block's usual keys, with
`num_nextn_predict_layers` = k in the target's config. Those loaders build DeepSeek blocks (MLA, MoE);
no engine loads this layout for a Llama-family target today, so this is the key map a future loader
(or a DeepSeek-family MTP head) uses.

Input: a list of MTP module state dicts under `common.MTP_KEYS`; `shared_head.head` is read over the
full vocabulary, so a head with a pruned draft vocabulary is refused. Our `norm` / `lm_head` become
`shared_head.norm` / `shared_head.head`; the block's `layers.0.*` keys sit directly under the layer.
Output: `mtp.safetensors` (MTP tensors only) and config.json = the target's config (when given) with
`num_nextn_predict_layers`; given the target's `model.safetensors.index.json`, a copy of it with the
MTP keys added (`stitched_index`), so the directory can be laid over a copy of the target checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specdistill.export import common

NAME = "deepseek_mtp"
WEIGHTS_FILE = "mtp.safetensors"
MODULE_KEY_MAP: dict[str, str] = {
    "embed_tokens.weight": "embed_tokens.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    **{f"layers.0.{k}": k for k in common.BLOCK_KEYS},
    "norm.weight": "shared_head.norm.weight",
    "lm_head.weight": "shared_head.head.weight",
}
REQUIRED_KEYS = tuple(MODULE_KEY_MAP.values())  # under `model.layers.{L+k}.`


def key_map(layer: int) -> dict[str, str]:
    """Our module keys -> the checkpoint keys of target decoder layer `layer`."""
    return {ours: f"model.layers.{layer}.{theirs}" for ours, theirs in MODULE_KEY_MAP.items()}


def convert(modules: Sequence[Mapping[str, torch.Tensor]], dims: common.MTPDims, dtype: str = "bfloat16",
            target_config: Mapping | None = None, target_index: Mapping | None = None) -> common.Converted:
    """Validated DeepSeek-style MTP tensors, config.json and (optionally) the stitched index."""
    common.check_mtp(modules, dims, f"{NAME} export", full_vocab_head=True)
    tensors: dict[str, torch.Tensor] = {}
    for k, state in enumerate(modules):
        tensors |= common.rename(common.cast(state, dtype), key_map(dims.target_num_layers + k))
    if target_config is not None:
        common.check_target_dims(target_config, common.mtp_target_dims(dims), f"{NAME} export")
        config = dict(target_config)
    else:
        config = common.llama_fields(dims.arch, dims.vocab_size) | {"num_hidden_layers": dims.target_num_layers}
    config["num_nextn_predict_layers"] = len(modules)
    extra = {}
    if target_index is not None:
        extra[common.INDEX_FILE] = common.stitched_index(target_index, WEIGHTS_FILE, sorted(tensors))
    return common.Converted(tensors, config, WEIGHTS_FILE, extra)
