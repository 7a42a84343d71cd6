"""DFlash layouts: vLLM's HF layout (the `DFlashDraftModel` config the DFlash authors publish) and speculators'.

Loader: vLLM `vllm/model_executor/models/qwen3_dflash.py`, `DFlashQwen3ForCausalLM` (registered as
`DFlashDraftModel`), served with `{"method": "dflash", "model": <dir>}`; a speculators export is turned into the same
HF config by `update_dflash` in `vllm/transformers_utils/configs/speculators/algos.py`. Its `load_weights` prefixes
every key but `lm_head`/`d2t` with `model.`, maps `d2t` to `draft_id_to_target_id` (int64) and skips `t2d`, so our
names go in unchanged: `fc`, `hidden_norm`, `layers.<i>.*` (Qwen3 blocks: `self_attn.q_norm`/`k_norm` per head), `norm`,
`lm_head` over the draft vocabulary, `embed_tokens` (the target's; its mask token's row embeds the mask slots).

Config: Qwen3 fields of the draft's layers (`model_type: qwen3`, `num_hidden_layers` the draft's), `draft_vocab_size`,
`target_hidden_size`, `block_size`, and the captured layers. vLLM's DFlash counts them as layer outputs:
`dflash_config.target_layer_ids` = our `aux_layer_ids` (it adds 1 for the target's capture, which counts inputs);
speculators counts inputs: `aux_hidden_state_layer_ids` = ours + 1 (`update_dflash` subtracts the 1). No `causal` and
no `layer_types`: vLLM then serves every layer non-causally, as trained. In the speculators layout,
`sliding_window_non_causal: true` is written: `update_dflash` turns a false (speculators' own default) into `causal:
true` for every layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specdistill.export import common
from specdistill.heads.dflash import DFlashConfig
from specdistill.heads.layers import HeadArch

LAYOUTS = ("vllm", "speculators")
ARCHITECTURE = "DFlashDraftModel"
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
NUM_AUX = 3  # vLLM's fc input is 3 x target_hidden_size for the captured layers it feeds
D2T_DTYPE = torch.int64


def is_dflash(config: Mapping) -> bool:
    return "dflash_config" in config or config.get("speculators_model_type") == "dflash"


def shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor, under our names (which both layouts keep)."""
    arch, d = config.arch, config.arch.hidden_size
    out = {"embed_tokens.weight": (config.vocab_size, d),
           "fc.weight": (d, len(config.aux_layer_ids) * config.target_hidden_size),
           "hidden_norm.weight": (d,), "norm.weight": (d,), "lm_head.weight": (config.draft_vocab_size, d),
           "d2t": (config.draft_vocab_size,), "t2d": (config.vocab_size,)}
    for i in range(config.num_layers):
        out |= {f"layers.{i}.{key}": shape for key, shape in common.block_shapes(arch, d).items()}
        out |= {f"layers.{i}.self_attn.q_norm.weight": (arch.head_dim,),
                f"layers.{i}.self_attn.k_norm.weight": (arch.head_dim,)}
    return out


def check(state: Mapping[str, torch.Tensor], config: DFlashConfig, where: str) -> None:
    common.check_tensors(state, shapes(config), where)
    common.check_vocab_map(state["d2t"], state["t2d"], config.vocab_size, where)
    ids, num_layers = list(config.aux_layer_ids), config.target_num_layers
    if len(ids) != NUM_AUX or any(not 0 <= i < num_layers for i in ids) or ids != sorted(set(ids)):
        raise common.ExportError(f"{where}: head config `aux_layer_ids` = {ids}, expected {NUM_AUX} distinct ascending "
                                 f"layer outputs in [0, {num_layers})")


def qwen3_fields(config: DFlashConfig, dtype: str) -> dict:
    return common.llama_fields(config.arch, config.vocab_size) | {
        "model_type": "qwen3", "num_hidden_layers": config.num_layers, "tie_word_embeddings": False,
        "torch_dtype": dtype, "dtype": dtype}


def convert(state: Mapping[str, torch.Tensor], config: DFlashConfig, fmt: str, dtype: str = "bfloat16",
            target: str | None = None, speculative_tokens: int = 3) -> common.Converted:
    """Validated tensors and config.json in layout `fmt`; the speculators layout names `target` as its verifier."""
    where = f"{fmt} export of a DFlash head"
    if fmt not in LAYOUTS:
        raise common.ExportError(f"export format {fmt!r} does not fit a DFlash head; expected one of {list(LAYOUTS)} "
                                 "(SGLang's and TensorRT-LLM's layouts are EAGLE-3's)")
    check(state, config, where)
    if not 1 <= speculative_tokens < config.block_size:
        raise common.ExportError(f"{where}: speculative_tokens = {speculative_tokens}; the head was trained on blocks "
                                 f"of {config.block_size}, so it drafts 1 to {config.block_size - 1}")
    tensors = common.cast(state, dtype, D2T_DTYPE)
    ids = [int(i) for i in config.aux_layer_ids]
    shared = {"draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size,
              "target_num_hidden_layers": config.target_num_layers, "block_size": config.block_size,
              "torch_dtype": dtype, "dtype": dtype}
    if fmt == "vllm":
        tensors.pop("t2d")
        fields = {"architectures": [ARCHITECTURE], **qwen3_fields(config, dtype), **shared,
                  "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": ids}}
        return common.Converted(tensors, fields)
    if not target:
        raise common.ExportError(f"{where}: no verifier; vLLM serves the target named in "
                                 "`speculators_config.verifier.name_or_path`, so give the target's HF id or local path")
    common.check_target_width(config, where)
    fields = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target, "architectures": []},
        },
        "transformer_layer_config": qwen3_fields(config, dtype),
        **shared,
        "aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
    }
    return common.Converted(tensors, fields)


def head_config(config: Mapping, where: str) -> DFlashConfig:
    """Rebuild the head config from either layout's config.json."""
    speculators = "speculators_model_type" in config
    layer = config["transformer_layer_config"] if speculators else config
    try:
        ids = ([i - 1 for i in config["aux_hidden_state_layer_ids"]] if speculators else
               list(config["dflash_config"]["target_layer_ids"]))
        heads = layer["num_attention_heads"]
        arch = HeadArch(hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
                        num_attention_heads=heads, num_key_value_heads=layer.get("num_key_value_heads", heads),
                        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
                        rms_norm_eps=layer["rms_norm_eps"], max_position_embeddings=layer["max_position_embeddings"],
                        rope_parameters=common.rope_from_config(layer, where))
        return DFlashConfig(
            arch=arch, vocab_size=layer["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"], aux_layer_ids=ids,
            target_num_layers=config["target_num_hidden_layers"], num_layers=layer["num_hidden_layers"],
            mask_token_id=config["mask_token_id"] if speculators else config["dflash_config"]["mask_token_id"],
            block_size=config["block_size"])
    except KeyError as err:
        raise common.ExportError(f"{where}: missing config field {err}") from err
