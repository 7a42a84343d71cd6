"""What every engine layout shares: validation against the head config, dtype casting, the config
fields every loader reads, key renaming, and the atomic write of one export directory.

Layer-id conventions: our `aux_layer_ids` are decoder-layer OUTPUT ids (1, L//2-1, L-4); SGLang and
TensorRT-LLM count the same way; vLLM and speculators count the INPUT of a layer (2, L//2, L-3).
Every layout writes both: `eagle_config.eagle_aux_hidden_state_layer_ids` (output, read by SGLang)
and top-level `eagle_aux_hidden_state_layer_ids` (input, read by vLLM and speculators).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdistill.heads.eagle3 import Eagle3Config
from specdistill.heads.layers import HeadArch
from specdistill.io import atomic_dir, save_tensors, write_json

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"

BLOCK_KEYS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
EAGLE3_KEYS = (
    "embed_tokens.weight",
    "fc.weight",
    *(f"midlayer.{k}" for k in BLOCK_KEYS),
    "midlayer.hidden_norm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


class ExportError(ValueError):
    """A head or an exported directory does not match a loader's contract; the message names the key."""


@dataclass
class Converted:
    """One layout, ready to write: tensors under the engine's names and its config.json."""

    tensors: dict[str, torch.Tensor]
    config: dict
    weights_file: str = WEIGHTS_FILE
    extra_json: dict[str, dict] = field(default_factory=dict)
    extra_tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # file name -> its tensors


def block_shapes(arch: HeadArch, in_dim: int) -> dict[str, tuple[int, ...]]:
    """One Llama decoder block whose q/k/v read `in_dim` features."""
    d, e = arch.hidden_size, arch.head_dim
    return {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (arch.num_attention_heads * e, in_dim),
        "self_attn.k_proj.weight": (arch.num_key_value_heads * e, in_dim),
        "self_attn.v_proj.weight": (arch.num_key_value_heads * e, in_dim),
        "self_attn.o_proj.weight": (d, arch.num_attention_heads * e),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (arch.intermediate_size, d),
        "mlp.up_proj.weight": (arch.intermediate_size, d),
        "mlp.down_proj.weight": (d, arch.intermediate_size),
    }


def optional_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Tensors only some EAGLE-3 heads have, named alike by every engine's loader: Eagle 3.1's norms before `fc`
    (`fc_norm`, one per captured layer in capture order) and P-EAGLE's `mask_hidden` (one captured-feature row)."""
    width = config.target_hidden_size
    norms = {f"fc_norm.{i}.weight": (width,) for i in range(len(config.aux_layer_ids))} if config.fc_norm else {}
    mask = {"mask_hidden": (1, len(config.aux_layer_ids) * width)} if config.parallel_drafting else {}
    return norms | mask


def eagle3_key_map(key_map: Mapping[str, str | None], config: Eagle3Config) -> dict[str, str | None]:
    """A layout's `KEY_MAP` for this head: with its optional keys, unrenamed, where it has them."""
    return {**key_map, **{key: key for key in optional_shapes(config)}}


def eagle3_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Shape of every EAGLE-3 tensor, under our (SGLang) key names."""
    d = config.arch.hidden_size
    shapes = {
        "embed_tokens.weight": (config.vocab_size, d),
        **optional_shapes(config),
        "fc.weight": (d, len(config.aux_layer_ids) * config.target_hidden_size),
        **{f"midlayer.{k}": s for k, s in block_shapes(config.arch, 2 * d).items()},
        "midlayer.hidden_norm.weight": (d,),
        "norm.weight": (d,),
        "lm_head.weight": (config.draft_vocab_size, d),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
    }
    assert set(shapes) == {*EAGLE3_KEYS, *optional_shapes(config)}
    return shapes


def check_tensors(state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Exact key set, shapes, and kinds: floating weights, integer `d2t`, bool `t2d`."""
    missing = sorted(set(shapes) - set(state))
    unexpected = sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise ExportError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")
    for key, shape in shapes.items():
        t = state[key]
        if tuple(t.shape) != tuple(shape):
            raise ExportError(f"{where}: `{key}` has shape {list(t.shape)}, expected {list(shape)}")
        if key == "t2d" and t.dtype != torch.bool:
            raise ExportError(f"{where}: `t2d` has dtype {t.dtype}, expected torch.bool")
        if key == "d2t" and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise ExportError(f"{where}: `d2t` has dtype {t.dtype}, expected an integer dtype")
        if key not in ("d2t", "t2d") and not t.dtype.is_floating_point:
            raise ExportError(f"{where}: `{key}` has dtype {t.dtype}, expected a floating dtype")
        if t.device.type != "cpu":
            raise ExportError(f"{where}: `{key}` is on {t.device}, expected a CPU tensor")


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where: str) -> None:
    """`d2t[i] = target_id - i` must name distinct target ids in range, and agree with `t2d`."""
    target_ids = torch.arange(len(d2t)) + d2t.long()
    if len(d2t) and (target_ids.min() < 0 or target_ids.max() >= vocab_size):
        raise ExportError(f"{where}: `d2t` maps draft ids outside the target vocabulary [0, {vocab_size})")
    if target_ids.unique().numel() != len(d2t):
        raise ExportError(f"{where}: `d2t` maps two draft ids to the same target id")
    if t2d is not None and (int(t2d.sum()) != len(d2t) or not bool(t2d[target_ids].all())):
        raise ExportError(f"{where}: `t2d` does not mark exactly the target ids named by `d2t`")


def check_eagle3(state: Mapping[str, torch.Tensor], config: Eagle3Config, where: str, num_aux: int | None) -> None:
    """Everything an EAGLE-3 writer checks before it writes: keys, shapes, dtypes, vocab map, layer ids."""
    check_tensors(state, eagle3_shapes(config), where)
    check_vocab_map(state["d2t"], state["t2d"], config.vocab_size, where)
    ids, num_layers = list(config.aux_layer_ids), config.target_num_layers
    if num_aux is not None and len(ids) != num_aux:
        raise ExportError(f"{where}: head config `aux_layer_ids` = {ids}; this engine's loader reads exactly "
                          f"{num_aux} captured layers (its fc input is {num_aux} x target_hidden_size)")
    if any(not 0 <= i < num_layers for i in ids) or ids != sorted(set(ids)):
        raise ExportError(f"{where}: head config `aux_layer_ids` = {ids}, expected distinct ascending layer outputs "
                          f"in [0, {num_layers}) (target_num_layers = {num_layers}): engines concatenate the "
                          "captured layers in ascending order")


def check_target_width(config: Eagle3Config, where: str) -> None:
    """Layouts whose loader gives the draft the target's embedding need a head as wide as the target."""
    if config.arch.hidden_size != config.target_hidden_size:
        raise ExportError(f"{where}: the head is {config.arch.hidden_size} wide, the target {config.target_hidden_size}; "
                          "this engine loads the target's embedding into the draft, so it serves only a head of the "
                          "target's width (the vllm layout carries the head's own embedding)")


def check_target_dims(target_config: Mapping, expected: Mapping[str, int], where: str) -> None:
    """The head fits the target it will be served with: each `expected` field equals the target's."""
    for name, value in expected.items():
        if target_config.get(name) != value:
            raise ExportError(f"{where}: target config `{name}` = {target_config.get(name)}, "
                              f"but the head was built for {value}")


def eagle3_target_dims(config: Eagle3Config) -> dict[str, int]:
    return {"vocab_size": config.vocab_size, "hidden_size": config.target_hidden_size,
            "num_hidden_layers": config.target_num_layers}


def cast(state: Mapping[str, torch.Tensor], dtype: str, d2t_dtype: torch.dtype = torch.int64) -> dict[str, torch.Tensor]:
    """Floating tensors to `dtype`; `d2t` to the engine's integer dtype; `t2d` stays bool."""
    if dtype not in DTYPES:
        raise ExportError(f"export dtype {dtype!r}: expected one of {list(DTYPES)}")
    out = {}
    for key, t in state.items():
        if key == "d2t" or key.endswith(".d2t"):
            out[key] = t.to(d2t_dtype)
        elif t.dtype.is_floating_point:
            out[key] = t.to(DTYPES[dtype])
        else:
            out[key] = t
    return out


def rename(state: Mapping[str, torch.Tensor], key_map: Mapping[str, str | None],
           config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Our key -> the engine's key (a layout's `KEY_MAP`, with the head's optional keys); a key mapped to None is
    deliberately not written."""
    key_map = eagle3_key_map(key_map, config)
    return {key_map[k]: v for k, v in state.items() if key_map[k] is not None}


def rope_fields(rope_parameters: Mapping) -> dict:
    """RoPE in the new (`rope_parameters`) and old (`rope_theta` + `rope_scaling`) spellings."""
    rope = dict(rope_parameters)
    if "rope_theta" not in rope or "rope_type" not in rope:
        raise ExportError(f"head config `arch.rope_parameters` = {rope}: expected `rope_type` and `rope_theta`")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope["rope_type"] == "default" else scaling,
    }


def rope_from_config(config: Mapping, where: str) -> dict:
    """Inverse of `rope_fields`: the new spelling, rebuilt from the old one if that is all there is. A config
    with neither is refused: guessing theta 10000 would read a head back at the wrong positions."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    if "rope_theta" not in config:
        raise ExportError(f"{where}: neither `rope_parameters` nor `rope_theta`; expected the head's RoPE")
    scaling = dict(config.get("rope_scaling") or {"rope_type": "default"})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {**scaling, "rope_theta": float(config["rope_theta"])}


def layer_id_fields(config: Eagle3Config) -> dict:
    """Captured layers in both conventions (see the module docstring)."""
    output_ids = [int(i) for i in config.aux_layer_ids]
    return {
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in output_ids],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": output_ids, "use_aux_hidden_state": True},
    }


def llama_fields(arch: HeadArch, vocab_size: int) -> dict:
    """The HF Llama config of the draft's decoder block (what `LlamaConfig(**fields)` rebuilds)."""
    return {
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        **rope_fields(arch.rope_parameters),
    }


def parallel_fields(config: Eagle3Config) -> dict:
    """P-EAGLE's fields: `mask_token_id` (vLLM reads it from the draft's config for the mask slots) and
    `parallel_drafting` (our reader's flag; vLLM takes it from the engine's speculative config)."""
    return {"parallel_drafting": True, "mask_token_id": config.mask_token_id} if config.parallel_drafting else {}


def eagle3_fields(config: Eagle3Config, dtype: str) -> dict:
    """Fields every EAGLE-3 layout writes: one draft layer, untied pruned lm_head, target dims, both id styles.

    `num_hidden_layers: 1` sizes the draft's layer stack; `tie_word_embeddings: false` stops SGLang from
    replacing `lm_head` with the embedding; `draft_vocab_size` sizes `lm_head` (a missing one makes the
    engines take the target's full lm_head); `target_hidden_size` sizes `fc`; `bias: false` is the `fc` bias
    flag SGLang and TensorRT-LLM read; `fc_norm` (top level, where vLLM, SGLang and TensorRT-LLM read it) builds
    the per-layer norms before `fc`; `target_num_hidden_layers` lets our reader rebuild the head config.
    """
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        **llama_fields(config.arch, config.vocab_size),
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "bias": False,
        "fc_norm": config.fc_norm,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "target_num_hidden_layers": config.target_num_layers,
        **layer_id_fields(config),
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def stitched_index(target_index: Mapping, weights_file: str, keys: Sequence[str]) -> dict:
    """A copy of the target's `model.safetensors.index.json` with `keys` pointing at `weights_file` (stale copies
    of them, a checkpoint's own MTP layer, are re-pointed: replacing it is the point)."""
    weight_map = dict(target_index.get("weight_map") or {})
    if not weight_map:
        raise ExportError("target checkpoint index: no `weight_map`; expected a model.safetensors.index.json")
    return {**target_index, "weight_map": weight_map | dict.fromkeys(keys, weights_file)}


def write_export(out_dir: str | Path, converted: Converted) -> Path:
    """Write the weights file + `config.json` (+ any extra json files) into `out_dir`, all or nothing. Files of
    the user's already in `out_dir` (a serve script, a model card) are carried over, not deleted."""
    out_dir = Path(out_dir)
    ours = {converted.weights_file, CONFIG_FILE, *converted.extra_json, *converted.extra_tensors}
    foreign = sorted(p for p in out_dir.iterdir() if p.name not in ours) if out_dir.is_dir() else []
    with atomic_dir(out_dir) as tmp:
        for path in foreign:
            (shutil.copytree if path.is_dir() else shutil.copy2)(path, tmp / path.name)
        if foreign:
            log.info("%s: kept %s, which the export does not write", out_dir, ", ".join(p.name for p in foreign))
        save_tensors(tmp / converted.weights_file, converted.tensors, metadata={"format": "pt"})
        write_json(tmp / CONFIG_FILE, converted.config)
        for name, obj in converted.extra_json.items():
            write_json(tmp / name, obj)
        for name, tensors in converted.extra_tensors.items():
            save_tensors(tmp / name, tensors, metadata={"format": "pt"})
    return out_dir


def read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.exists():
        raise ExportError(f"{directory}: no {CONFIG_FILE}; expected an exported head directory")
    return json.loads(path.read_text())
