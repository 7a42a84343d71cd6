"""A target's own MTP layer, in the keys of its own checkpoint: the fine-tuned module replaces the stale one.

Where each family's checkpoint holds MTP layer 0 (L = `num_hidden_layers`), as vLLM (`deepseek_mtp.py`,
`glm4_moe_mtp.py`, `qwen3_next_mtp.py`, `mimo_mtp.py`) and SGLang load it with `speculative_config={"method": "mtp"}`:

- DeepSeek-V3, GLM-4.5: `model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm}` beside the block's keys, plus the
  layer's copies of the embedding and head (`embed_tokens`, `shared_head.head`: here the target's own);
- Qwen3-Next: `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}` and the block under `mtp.layers.0.`;
- MiMo: `model.mtp_layers.0.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}` beside the block's keys.

The block's keys are written as the target's checkpoint writes its layers (transformers' conversion reverted: MoE
experts one by one, as the released checkpoints hold them). The engines draft with the target's embedding and
lm_head.

Output: `mtp.safetensors` and config.json (the target checkpoint's, else the one the head recorded, with
`num_nextn_predict_layers: 1`). Given the target's checkpoint dir: for a sharded one, also its index with the MTP
keys pointing at `mtp.safetensors` and a copy of each shard that held the stale MTP layer, without it (an engine
reads every tensor of every shard); a one-file checkpoint gets its `model.safetensors` whole, with the MTP layer
in it (transformers reads no second file beside it). Laid over a copy of the target checkpoint, the directory is
served as is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from specdistill.export import common
from specdistill.heads.native_mtp import layer_prefixes

NAME = "native_mtp"
WEIGHTS_FILE = "mtp.safetensors"


def checkpoint_tensors(head) -> dict[str, torch.Tensor]:
    """The head's MTP layer under the target checkpoint's keys."""
    hf_config = head.config.hf_config()
    family = head.family
    L = hf_config.num_hidden_layers
    own_prefix, block_prefix = layer_prefixes(family, L)
    layer = head.layer.state_dict()
    with torch.device("meta"):  # only its conversion mapping is read: no weights are made
        shell = AutoModelForCausalLM.from_config(hf_config)
    as_layer = f"model.layers.{L}."  # the conversion is written for the target's own layers
    block = revert_weight_conversion(shell, {as_layer + k.removeprefix("mtp_block."): v.detach().cpu()
                                             for k, v in layer.items() if k.startswith("mtp_block.")})
    block = {block_prefix + k.removeprefix(as_layer): v for k, v in block.items()}
    own = {own_prefix + theirs: layer[ours].detach().cpu() for ours, theirs in family.module_keys.items()}
    shared = {own_prefix + "embed_tokens.weight": head.embed_tokens.weight.detach().cpu(),
              own_prefix + "shared_head.head.weight": head.lm_head.weight.detach().cpu()} if family.holds_shared else {}
    return block | own | shared


def convert(head, dtype: str = "bfloat16", checkpoint: str | Path | None = None) -> common.Converted:
    """Validated tensors and config.json; given the target's checkpoint dir, its index with the MTP keys
    re-pointed and a copy of every shard that held stale MTP keys, without them."""
    c = head.config
    if c.kind != "native_mtp":
        raise common.ExportError(
            f"{NAME} export: a {c.kind} head has no engine layout. No engine serves an MTP head on a target without "
            "its own MTP layers (Llama, SmolLM2): the engines' MTP loaders build the target family's block from the "
            "target's MTP config. This head stays a research option, evaluated here.")
    if c.draft_vocab_size != c.vocab_size:
        raise common.ExportError(f"{NAME} export: the head drafts over {c.draft_vocab_size} tokens; the engine "
                                 f"drafts with the target's full lm_head ({c.vocab_size})")
    tensors = common.cast(checkpoint_tensors(head), dtype)
    checkpoint = Path(checkpoint) if checkpoint is not None else None
    own = checkpoint / common.CONFIG_FILE if checkpoint is not None else None
    config = json.loads(own.read_text()) if own is not None and own.exists() else dict(c.target_config)
    converted = common.Converted(tensors, config | {"num_nextn_predict_layers": 1}, WEIGHTS_FILE)
    if checkpoint is None:
        return converted
    one_file = checkpoint / common.WEIGHTS_FILE
    if one_file.exists():  # a one-file checkpoint holds its MTP layer in that file (transformers reads no other)
        with safe_open(str(one_file), "pt") as f:
            converted.tensors = {k: f.get_tensor(k) for k in f.keys() if k not in tensors} | tensors
        converted.weights_file = common.WEIGHTS_FILE
        return converted
    index_path = checkpoint / common.INDEX_FILE
    if index_path.exists():
        index = json.loads(index_path.read_text())
        converted.extra_json[common.INDEX_FILE] = common.stitched_index(index, WEIGHTS_FILE, sorted(tensors))
    for shard in sorted(checkpoint.glob("*.safetensors")):
        if shard.name == WEIGHTS_FILE:
            continue  # replaced whole by this export
        with safe_open(str(shard), "pt") as f:
            if any(k in tensors for k in f.keys()):
                converted.extra_tensors[shard.name] = {k: f.get_tensor(k) for k in f.keys() if k not in tensors}
    return converted
