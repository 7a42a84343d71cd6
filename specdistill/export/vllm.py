"""vLLM EAGLE-3 layout (HF Llama config).

Loader: vLLM `vllm/model_executor/models/llama_eagle3.py`, class `Eagle3LlamaForCausalLM` (registered
also as `LlamaForCausalLMEagle3`, the name we write). Its `load_weights` renames `midlayer.` to
`layers.0.`, maps `d2t` to `draft_id_to_target_id` (int64 parameter) and skips `t2d`, so we write our
names unchanged, `d2t` as int64 and no `t2d`. `embed_tokens.weight` is written (vLLM loads it when
present; it equals the target's). An Eagle 3.1 head's `fc_norm.<i>.weight` go in unrenamed (`model.fc_norm.<i>`,
built when the config says `fc_norm: true`); vLLM does not check that a draft's weights all arrived (its
`load_weights` returns nothing), so a missing one would silently stay at ones: the key set is pinned here.

Config: the common EAGLE-3 fields plus the flags vLLM reads: top-level
`eagle_aux_hidden_state_layer_ids` (input-to-layer ids; vLLM passes them to the target's
`set_aux_hidden_state_layers`), `norm_before_residual: false` (our residual is the un-normed hidden
state; vLLM's speculators path defaults it to true, so it is always written), and
`eagle_config.use_aux_hidden_state: true` (otherwise vLLM drops `fc`).

P-EAGLE: `mask_hidden` [1, 3 x target_hidden] (vLLM's buffer of that shape, refused if absent when parallel
drafting is on) and `mask_token_id` in config.json; the server turns it on with `"parallel_drafting": true` in
its speculative config (the speculators layout turns it on by itself).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specdistill.export import common
from specdistill.heads.eagle3 import Eagle3Config

NAME = "vllm"
KEY_MAP: dict[str, str | None] = {key: key for key in common.EAGLE3_KEYS} | {"t2d": None}
REQUIRED_KEYS = tuple(v for v in KEY_MAP.values() if v is not None)
D2T_DTYPE = torch.int64
NUM_AUX = 3  # fc input is hard-wired to 3 x target_hidden_size


def convert(state: Mapping[str, torch.Tensor], config: Eagle3Config, dtype: str = "bfloat16",
            target: str | None = None, speculative_tokens: int = 3) -> common.Converted:
    """Validated vLLM tensors and config.json for one head (`target` is not recorded here)."""
    common.check_eagle3(state, config, f"{NAME} export", NUM_AUX)
    fields = common.eagle3_fields(config, dtype) | {"norm_before_residual": False} | common.parallel_fields(config)
    return common.Converted(common.rename(common.cast(state, dtype, D2T_DTYPE), KEY_MAP, config), fields)
