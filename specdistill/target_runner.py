"""The frozen target run once per batch: forward hooks return the captured aux features, the last hidden state
and the logits (`TargetRunner`). Everything that depends on the target's family when it runs lives here: the
decoder-layer list, the final norm, the capture hooks, the KV-cache keyword, and the refusal of a recurrent state
that batched decoding cannot roll back.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from torch import nn

from specdistill.config import ConfigError
from specdistill.decode.kv import ReplayCache
from specdistill.target import Target


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of any HF decoder-only model (Llama, Qwen, Mistral, Gemma, ...)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for name in ("layers", "h", "blocks"):
        if isinstance(getattr(base, name, None), nn.ModuleList):
            return getattr(base, name)
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")


def keeps_recurrent_state(model: nn.Module) -> bool:
    """The target has linear-attention layers (Qwen3-Next's gated DeltaNet): a recurrent state, not a KV cache."""
    return "linear_attention" in (getattr(model.config, "layer_types", None) or [])


def require_kv_cache(model: nn.Module, what: str) -> None:
    """Our batched decoding (local regeneration, plain decoding, the tree evaluator) keeps, trims and rolls back a KV
    cache per layer, which a recurrent state cannot do. Refuse such a target by name before any work (only one
    row drafting a chain is replayed exactly: `ReplayCache`)."""
    if keeps_recurrent_state(model):
        raise ConfigError(
            f"{what}: the target {type(model).__name__} has linear-attention layers, whose recurrent state our "
            "batched KV-cache decoding cannot roll back. Regenerate with data.generation.backend=openai (a vLLM "
            "server) or data.regenerate=false, and measure acceptance with eval.engine against our chain "
            "(scripts/mtp_stale.py family=qwen3_next)")


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def with_kv_cache(model: nn.Module, cache) -> dict:
    """The keyword arguments that hand a transformers model its KV cache: transformers 5.2 renamed `past_key_values`
    to `cache` (5.40 drops the old name), and older releases know only the old one."""
    return {_cache_keyword(type(model)): cache, "use_cache": True}


@dataclasses.dataclass
class TargetOutput:
    aux_BTA: torch.Tensor  # cat of captured layer outputs, A = len(layer_ids) * H
    last_BTH: torch.Tensor  # output of the final decoder layer, before the final norm
    logits_BTV: torch.Tensor | None


class TargetRunner:
    """Runs the frozen target once and returns the captured features, via forward hooks.

    Only the captured layers' outputs are kept (not every layer's hidden states).
    """

    def __init__(self, target: Target):
        self.target = target
        self.layers = decoder_layers(target.model)
        self.base = target.model.get_decoder()
        self.wanted = sorted(set(target.layer_ids) | {len(self.layers) - 1})
        self._captured: dict[int, torch.Tensor] = {}

    def _hook(self, idx: int):
        def save(_module, _inputs, output):
            self._captured[idx] = output[0] if isinstance(output, tuple) else output

        return save

    @torch.inference_mode()
    def __call__(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                 with_logits: bool = True) -> TargetOutput:
        """The captured features (and logits) at `input_ids`, after what `cache` holds: a transformers cache, or a
        ReplayCache whose committed tokens run again in front of them."""
        new = input_ids.shape[1]  # the positions asked for (a replay runs the committed ones in front of them)
        if isinstance(cache, ReplayCache):
            input_ids, attention_mask, position_ids = cache.replay(input_ids, attention_mask, position_ids)
            cache = None
        handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in self.wanted]
        try:
            out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            **(with_kv_cache(self.base, cache) if cache is not None else {"use_cache": False}))
        finally:
            for h in handles:
                h.remove()
        captured, self._captured = self._captured, {}
        aux = torch.cat([captured[i][:, -new:] for i in self.target.layer_ids], dim=-1)
        last = captured[len(self.layers) - 1][:, -new:]
        logits = self.target.model.get_output_embeddings()(out.last_hidden_state[:, -new:]) if with_logits else None
        return TargetOutput(aux, last, logits)

    def final_norm(self) -> nn.Module:
        return self.base.norm
