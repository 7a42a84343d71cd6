"""SGLang EAGLE-3 layout.

Loader: SGLang `python/sglang/srt/models/llama_eagle3.py`, class `LlamaForCausalLMEagle3`, chosen by
`architectures` in config.json. Its modules are named like ours (`fc`, `midlayer`, `norm`, `lm_head`),
so no key is renamed; keys it does not know are skipped silently, which is why the key set is pinned.

Weights: all floating tensors in the export dtype; `d2t` int64 (SGLang turns it into `hot_token_id`);
`embed_tokens.weight` is written (SGLang replaces it by the target's, which it equals); `t2d` is not
written (SGLang skips it). Config: the common EAGLE-3 fields (`common.eagle3_fields`); SGLang reads
`draft_vocab_size`, `tie_word_embeddings`, `target_hidden_size`, `bias`, and
`eagle_config.eagle_aux_hidden_state_layer_ids` (output-of-layer ids, to which it adds one).

Eagle 3.1 (`fc_norm`): SGLang builds `model.fc_norm` from the top-level `fc_norm` and loads our
`fc_norm.<i>.weight` into it since sgl-project/sglang#24663; an older SGLang skips the flag and the weights
silently and serves the head without its norms.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specdistill.export import common
from specdistill.heads.eagle3 import Eagle3Config

NAME = "sglang"
KEY_MAP: dict[str, str | None] = {key: key for key in common.EAGLE3_KEYS} | {"t2d": None}
REQUIRED_KEYS = tuple(v for v in KEY_MAP.values() if v is not None)
D2T_DTYPE = torch.int64
NUM_AUX = 3  # fc input is hard-wired to 3 x target_hidden_size


def convert(state: Mapping[str, torch.Tensor], config: Eagle3Config, dtype: str = "bfloat16",
            target: str | None = None, speculative_tokens: int = 3) -> common.Converted:
    """Validated SGLang tensors and config.json for one head (`target` is not recorded here)."""
    common.check_eagle3(state, config, f"{NAME} export", NUM_AUX)
    common.check_target_width(config, f"{NAME} export")
    return common.Converted(common.rename(common.cast(state, dtype, D2T_DTYPE), KEY_MAP, config),
                            common.eagle3_fields(config, dtype))
