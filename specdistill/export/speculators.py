"""speculators EAGLE-3 layout (the format vLLM auto-detects).

Loaders: vLLM `vllm/transformers_utils/configs/speculators/` (`SpeculatorsConfig`, `update_eagle3`
in `algos.py`), which turns this config into an HF one for `Eagle3LlamaForCausalLM`; and the
`speculators` package, `speculators/models/eagle3/core.py`, class `Eagle3DraftModel`.

Weights: `midlayer.*` renamed to `layers.0.*` (both loaders build a `layers` list); `d2t` int64 and
`t2d` bool (the speculators package registers both as buffers); `embed_tokens.weight` written (the
package would otherwise start from NaNs until it copies the verifier's).

Config: `speculators_model_type: eagle3`; `transformer_layer_config` (the HF Llama config of the
draft block, `num_hidden_layers: 1`, vocab = the target's); `speculators_config` with one greedy
proposal method and the verifier (vLLM requires `verifier.name_or_path` and `speculative_tokens`;
`vllm serve <this dir>` serves the verifier with this draft); top level `draft_vocab_size`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (input-to-layer ids), and
`norm_before_residual: false` (vLLM defaults it to true here, which would change the model), plus the
speculators flags `norm_before_fc` and `norm_output` false and `fc_norm` the head's (vLLM's `update_eagle3` passes
it on; both loaders then build `fc_norm.<i>` and take our `fc_norm.<i>.weight` as they are).

P-EAGLE: `speculators_model_type: peagle` (vLLM's `update_peagle` turns on parallel drafting and reads
`mask_token_id`), `mask_hidden` as speculators' [1, 1, 3 x target_hidden] parameter (vLLM views it flat). That
reader passes no `fc_norm` on, so a P-EAGLE head with Eagle 3.1's norms is refused here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specdistill.export import common
from specdistill.heads.eagle3 import Eagle3Config

NAME = "speculators"
KEY_MAP: dict[str, str | None] = {key: key.replace("midlayer.", "layers.0.") for key in common.EAGLE3_KEYS}
REQUIRED_KEYS = tuple(v for v in KEY_MAP.values() if v is not None)
D2T_DTYPE = torch.int64
NUM_AUX = 3  # vLLM's fc input is hard-wired to 3 x target_hidden_size
ARCHITECTURE = "Eagle3Speculator"


def convert(state: Mapping[str, torch.Tensor], config: Eagle3Config, dtype: str = "bfloat16",
            target: str | None = None, speculative_tokens: int = 3) -> common.Converted:
    """Validated speculators tensors and config.json; `target` is the verifier's HF id or path (vLLM serves it with
    this draft, so it is required), `speculative_tokens` the chain vLLM drafts by default."""
    common.check_eagle3(state, config, f"{NAME} export", NUM_AUX)
    if not target:
        raise common.ExportError(f"{NAME} export: no verifier; vLLM serves the target named in "
                                 "`speculators_config.verifier.name_or_path`, so give the target's HF id or local path "
                                 "(scripts/export.py verifier=<id or path>)")
    if speculative_tokens < 1:
        raise common.ExportError(f"{NAME} export: speculative_tokens = {speculative_tokens}, expected at least 1")
    common.check_target_width(config, f"{NAME} export")
    if config.parallel_drafting and config.fc_norm:
        raise common.ExportError(f"{NAME} export: a P-EAGLE head with Eagle 3.1's fc_norm; vLLM reads this layout's "
                                 "`peagle` config without `fc_norm` and would serve the head without its norms: "
                                 "export the vllm layout instead")
    model_type = "peagle" if config.parallel_drafting else "eagle3"
    layer = common.llama_fields(config.arch, config.vocab_size) | {
        "num_hidden_layers": 1, "tie_word_embeddings": False, "torch_dtype": dtype, "dtype": dtype}
    fields = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": model_type,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target, "architectures": []},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "target_num_hidden_layers": config.target_num_layers,
        **common.layer_id_fields(config),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": config.fc_norm,
        "norm_output": False,
        "torch_dtype": dtype,
        "dtype": dtype,
    } | ({"mask_token_id": config.mask_token_id} if config.parallel_drafting else {})
    tensors = common.rename(common.cast(state, dtype, D2T_DTYPE), KEY_MAP, config)
    if "mask_hidden" in tensors:
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)  # speculators' parameter shape
    return common.Converted(tensors, fields)
