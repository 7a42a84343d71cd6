"""Read any of our EAGLE-3 exports (sglang, vllm, speculators, trtllm) back into an `Eagle3Head`, and a DFlash export
(vllm, speculators) into a `DFlashHead`.

The layout is recognised from config.json, and its writer's `KEY_MAP` is inverted, so a renamed or
missing key is reported by name. `t2d`, which most layouts do not write, is rebuilt from `d2t`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from specdistill.export import EAGLE3_LAYOUTS, common, dflash
from specdistill.heads.dflash import DFlashHead
from specdistill.heads.eagle3 import Eagle3Config, Eagle3Head
from specdistill.heads.layers import HeadArch


def detect_layout(config: dict) -> str:
    """Which writer produced this config.json (the layouts differ in the fields they add; a target's own MTP
    layer comes with the target's config, which declares it)."""
    if config.get("num_nextn_predict_layers"):
        return "native_mtp"
    if "speculators_model_type" in config:
        return "speculators"
    if "next_layer_regular" in (config.get("eagle_config") or {}):
        return "trtllm"
    if "norm_before_residual" in config or dflash.is_dflash(config):
        return "vllm"
    return "sglang"


def aux_layer_ids(config: dict, where: str) -> list[int]:
    """Output-of-layer ids, from `eagle_config` or else from the top-level input-to-layer ids."""
    output_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    input_ids = config.get("eagle_aux_hidden_state_layer_ids")
    if output_ids is None and input_ids is None:
        raise common.ExportError(f"{where}: no `eagle_aux_hidden_state_layer_ids`; expected the captured layers")
    if output_ids is not None and input_ids is not None and [i + 1 for i in output_ids] != list(input_ids):
        raise common.ExportError(f"{where}: `eagle_config.eagle_aux_hidden_state_layer_ids` = {output_ids} "
                                 f"(output of layer) disagrees with top-level {input_ids} (input to layer)")
    return list(output_ids) if output_ids is not None else [i - 1 for i in input_ids]


def head_config(config: dict, where: str) -> Eagle3Config:
    """Rebuild the head config from an exported config.json."""
    layer = config["transformer_layer_config"] if "speculators_model_type" in config else config
    parallel = bool(config.get("parallel_drafting")) or config.get("speculators_model_type") == "peagle"
    try:
        heads = layer["num_attention_heads"]
        arch = HeadArch(
            hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
            num_attention_heads=heads, num_key_value_heads=layer.get("num_key_value_heads", heads),
            head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
            rms_norm_eps=layer["rms_norm_eps"], max_position_embeddings=layer["max_position_embeddings"],
            rope_parameters=common.rope_from_config(layer, where),
        )
        return Eagle3Config(
            arch=arch, vocab_size=layer["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            aux_layer_ids=aux_layer_ids(config, where), target_num_layers=config["target_num_hidden_layers"],
            fc_norm=bool(config.get("fc_norm", False)),  # top level in every layout; absent: plain EAGLE-3
            parallel_drafting=parallel, mask_token_id=config["mask_token_id"] if parallel else None,
        )
    except KeyError as err:
        raise common.ExportError(f"{where}: missing config field {err}") from err


def read_head(directory: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3Head | DFlashHead:
    """Load an exported EAGLE-3 or DFlash directory into a head (floating weights in `dtype`)."""
    directory = Path(directory)
    config = common.read_config(directory)
    where = str(directory / common.CONFIG_FILE)
    if detect_layout(config) == "native_mtp":
        raise common.ExportError(f"{where}: a target checkpoint with its own MTP layer, not a draft head export; "
                                 "pass the head's checkpoint (runs/<name>/ckpt/best) instead")
    is_dflash = dflash.is_dflash(config)
    head_cfg = dflash.head_config(config, where) if is_dflash else head_config(config, where)
    weights = directory / common.WEIGHTS_FILE
    if not weights.exists():
        raise common.ExportError(f"{directory}: no {common.WEIGHTS_FILE}; expected the exported weights")
    tensors = load_file(str(weights))
    if is_dflash:  # both layouts keep our names
        ours = {key: key for key in dflash.shapes(head_cfg)}
    else:
        layout = EAGLE3_LAYOUTS[detect_layout(config)]
        key_map = common.eagle3_key_map(layout.KEY_MAP, head_cfg)
        ours = {theirs: mine for mine, theirs in key_map.items() if theirs is not None}
    unknown = sorted(set(tensors) - set(ours))
    if unknown:
        raise common.ExportError(f"{weights}: keys {unknown} are not in the {detect_layout(config)} layout")
    state = {ours[k]: v for k, v in tensors.items()}
    if "mask_hidden" in state:
        state["mask_hidden"] = state["mask_hidden"].reshape(1, -1)  # speculators keeps it [1, 1, A]
    if "d2t" in state and "t2d" not in state:
        common.check_vocab_map(state["d2t"], None, head_cfg.vocab_size, str(weights))
        target_ids = torch.arange(len(state["d2t"])) + state["d2t"].long()
        state["t2d"] = torch.zeros(head_cfg.vocab_size, dtype=torch.bool).index_fill_(0, target_ids, True)
    if is_dflash:
        dflash.check(state, head_cfg, str(weights))
    else:
        common.check_eagle3(state, head_cfg, str(weights), num_aux=None)
    head = DFlashHead(head_cfg) if is_dflash else Eagle3Head(head_cfg)
    state = {k: (v.long() if k == "d2t" else v.to(dtype) if v.dtype.is_floating_point else v) for k, v in state.items()}
    head.load_state_dict(state, strict=False)
    return head.to(dtype)
