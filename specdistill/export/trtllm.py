"""TensorRT-LLM EAGLE-3 layout (PyTorch backend).

Loader: TensorRT-LLM `tensorrt_llm/_torch/models/modeling_speculative.py`, classes `Eagle3ForCausalLM`
/ `Eagle3DraftModel`. Its modules are `fc`, `midlayer` (one `Eagle3DecoderLayer`), `norm`, `lm_head`
and a `d2t` parameter of dtype int32 (created when `draft_vocab_size != vocab_size`), so keys are
ours unchanged and `d2t` is written as int32. `lm_head.weight` must be present, or the target's full
lm_head is used. `embed_tokens.weight` is written for our reader; TensorRT-LLM loads it only when
`target_hidden_size != hidden_size` (otherwise it shares the target's, which it equals). `t2d` is not
read and not written.

Config: the common EAGLE-3 fields (`draft_vocab_size`, `target_hidden_size`, `bias`, `fc_norm`,
`num_hidden_layers: 1`, rope in both spellings) plus `eagle_config` flags the draft model reads, all
off for our head. The architecture and the captured layers come from the serving options
(`speculative_config.eagle3_layers_to_capture`, output-of-layer ids, default (1, L//2-1, L-4)).
Eagle 3.1 (`fc_norm`): `Eagle3DraftModel` reads the top-level `fc_norm` (NVIDIA/TensorRT-LLM#14988), builds one
norm per captured layer and applies them in `Eagle3ForCausalLM.apply_eagle3_fc`; our `fc_norm.<i>.weight` load
under `model.` as the other keys do.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specdistill.export import common
from specdistill.heads.eagle3 import Eagle3Config

NAME = "trtllm"
KEY_MAP: dict[str, str | None] = {key: key for key in common.EAGLE3_KEYS} | {"t2d": None}
REQUIRED_KEYS = tuple(v for v in KEY_MAP.values() if v is not None)
D2T_DTYPE = torch.int32
NUM_AUX = None  # fc input is num_capture_layers x target_hidden_size, from the serving options
EAGLE_FLAGS = {"eh_proj_before_attn": False, "norm_before_fc": False, "return_hidden_post_norm": False,
               "next_layer_regular": True}


def convert(state: Mapping[str, torch.Tensor], config: Eagle3Config, dtype: str = "bfloat16",
            target: str | None = None, speculative_tokens: int = 3) -> common.Converted:
    """Validated TensorRT-LLM tensors and config.json for one head (`target` is not recorded here)."""
    common.check_eagle3(state, config, f"{NAME} export", NUM_AUX)
    fields = common.eagle3_fields(config, dtype)
    fields["eagle_config"] = {**fields["eagle_config"], **EAGLE_FLAGS}
    return common.Converted(common.rename(common.cast(state, dtype, D2T_DTYPE), KEY_MAP, config), fields)
