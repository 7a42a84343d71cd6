"""The target's own MTP module (DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo: MTP layers declared in its config),
fine-tuned as the serving engine runs it.

Built from the target's transformers classes (its decoder layer, RMSNorm and rotary, through transformers'
`MtpLayer`: `enorm`, `hnorm`, `eh_proj`, `mtp_block`, `post_norm`), initialised from the checkpoint's MTP
weights when it has them. The draft step is vLLM's (`deepseek_mtp.py`, `glm4_moe_mtp.py`, `qwen3_next_mtp.py`,
`mimo_mtp.py`, V1 proposer), per family in `MTP_FAMILIES`:

- step 0 reads the target's output after its final norm (the store keeps it before: `target_norm` applies it);
- x = eh_proj(cat(enorm(embedding), hnorm(hidden))), MiMo's halves the other way round; the embedding is zeroed
  at position 0 except on Qwen3-Next;
- h = mtp_block(x); logits = lm_head(post_norm(h)) with the target's own embedding and lm_head (the engine
  drafts with the target's, so both stay frozen here);
- the next step reads post_norm(h), except on GLM-4.5 (h), always through MTP layer 0 (the proposer passes no
  step index), at the next position.

Attention runs through a registered transformers attention function that hands q, k, v to the caller's
`attend` (the Training-Time Test's, or the drafter's KV cache), so the block is the target's class, unchanged.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, WeightRenaming
from transformers.modeling_layers import MtpLayer, MtpModel
from transformers.modeling_utils import AttentionInterface
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from specdistill.heads.base import DraftHead, TargetFields
from specdistill.heads.layers import HeadArch

log = logging.getLogger(__name__)

DRAFT_ATTENTION = "specdistill_draft"


@dataclass(frozen=True)
class MtpFamily:
    """Where a family's checkpoint holds MTP layer 0 and how vLLM runs it."""

    module_prefix: str  # the layer's own tensors (`{L}`: the target's num_hidden_layers)
    module_keys: dict  # `MtpLayer` key -> the checkpoint's, under module_prefix
    block_prefix: str  # the decoder block's tensors
    carries_normed: bool  # the next draft step reads post_norm(h), not h
    masks_position0: bool = True  # the embedding at position 0 is zeroed
    hidden_first: bool = False  # eh_proj reads cat(hidden, embedding)
    holds_shared: bool = False  # the layer keeps its own copies of the embedding and lm_head
    classes_of: str | None = None  # the model_type whose transformers classes build it (else the target's)


DEEPSEEK_KEYS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                 "post_norm.weight": "shared_head.norm.weight"}
MTP_FAMILIES = {
    "deepseek_v3": MtpFamily("model.layers.{L}.", DEEPSEEK_KEYS, "model.layers.{L}.", True, holds_shared=True),
    "glm4_moe": MtpFamily("model.layers.{L}.", DEEPSEEK_KEYS, "model.layers.{L}.", False, holds_shared=True),
    "qwen3_next": MtpFamily("mtp.", {"enorm.weight": "pre_fc_norm_embedding.weight",
                                     "hnorm.weight": "pre_fc_norm_hidden.weight", "eh_proj.weight": "fc.weight",
                                     "post_norm.weight": "norm.weight"}, "mtp.layers.0.", True, masks_position0=False),
    "mimo": MtpFamily("model.mtp_layers.0.", {"enorm.weight": "token_layernorm.weight",
                                              "hnorm.weight": "hidden_layernorm.weight",
                                              "eh_proj.weight": "input_proj.weight",
                                              "post_norm.weight": "final_layernorm.weight"},
                      "model.mtp_layers.0.", True, hidden_first=True, classes_of="qwen2"),
}
MIMO_ARCHITECTURE = "MiMoForCausalLM"  # a Qwen2 model with MTP layers (its config's model_type is qwen2 or mimo)


def draft_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, draft_attend=None,
                    **kwargs):
    """transformers' attention interface, answered by the head's `attend(q, k, v)`. A scaling other than
    1/sqrt(head dim) (DeepSeek's YaRN mscale) is folded into q, so every attention core keeps its default."""
    if draft_attend is None:
        raise RuntimeError("the MTP block ran without a draft `attend`: call it through NativeMTPHead.step")
    default = query.shape[-1] ** -0.5
    if scaling is not None and abs(scaling - default) > 1e-12 * default:
        query = query * (scaling / default)
    return draft_attend(query, key, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(DRAFT_ATTENTION, draft_attention)


def family_name(fields: dict) -> str:
    """The key of `MTP_FAMILIES` for a target config's fields (MiMo is told by its architecture)."""
    return "mimo" if MIMO_ARCHITECTURE in (fields.get("architectures") or []) else fields["model_type"]


def declares_mtp(target_config) -> bool:
    """The target ships MTP layers of a family whose module is built and served here."""
    fields = target_config.to_dict()
    layers = fields.get("num_nextn_predict_layers") or fields.get("mtp_num_hidden_layers") or 0
    return family_name(fields) in MTP_FAMILIES and layers > 0


def family_classes(hf_config) -> tuple[type, type, type]:
    """The target family's decoder layer, RMSNorm and rotary embedding classes."""
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    module = importlib.import_module(model_cls.__module__)
    prefix = model_cls.__name__.removesuffix("ForCausalLM")
    return tuple(getattr(module, f"{prefix}{part}") for part in ("DecoderLayer", "RMSNorm", "RotaryEmbedding"))


def with_one_mtp_layer(hf_config):
    """A copy of the config that transformers' `get_mtp_config` reads as one full-attention MTP layer (configs
    without transformers' MTP fields: Qwen3-Next, MiMo), in the family's concatenation order."""
    config = copy.deepcopy(hf_config)
    if getattr(config, "num_mtp_layers", None) is None:
        config.num_mtp_layers = 1
    if getattr(config, "layer_types", None) is not None and getattr(config, "mtp_layer_types", None) is None:
        config.mtp_layer_types = ["full_attention"]
    config.mtp_hidden_states_first = MTP_FAMILIES[family_name(hf_config.to_dict())].hidden_first
    return config


@dataclass
class NativeMTPConfig(TargetFields):  # the full vocabulary drafted (the target's lm_head); the module reads only `last`
    target_config: dict  # the target's transformers config (to_dict): the module's classes and sizes
    kind: str = "native_mtp"

    @property
    def family(self) -> MtpFamily:
        return MTP_FAMILIES[family_name(self.target_config)]

    def hf_config(self):
        """The target's config in its family's classes, answering attention through `draft_attention`."""
        classes_of = self.family.classes_of
        config = AutoConfig.for_model(**(self.target_config | ({"model_type": classes_of} if classes_of else {})))
        config._attn_implementation = DRAFT_ATTENTION
        config._experts_implementation = "eager"  # the MoE block's plain loop: no kernel choice outside a model
        return config

    @property
    def arch(self) -> HeadArch:
        """The block's attention dimensions, as the serving advice costs a head."""
        c = self.hf_config()
        head_dim = getattr(c, "qk_nope_head_dim", 0) + getattr(c, "qk_rope_head_dim", 0) or c.head_dim
        return HeadArch(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                        head_dim=head_dim, rope_parameters=dict(c.rope_parameters))


class NativeMTPHead(DraftHead):
    def __init__(self, config: NativeMTPConfig):
        super().__init__(config.vocab_size, config.draft_vocab_size, config.target_hidden_size)
        self.config = config
        hf_config = config.hf_config()
        layer_cls, norm_cls, rotary_cls = family_classes(hf_config)
        mtp_config = with_one_mtp_layer(hf_config).get_mtp_config()
        self.family = config.family
        self.layer = MtpLayer(mtp_config, layer_cls, norm_cls, 0, use_post_norm=True)
        self.target_norm = norm_cls(hf_config.hidden_size, eps=hf_config.rms_norm_eps).requires_grad_(False)
        self.rotary = rotary_cls(config=mtp_config)
        self.num_heads = hf_config.num_attention_heads
        self.lm_head.weight.requires_grad_(False)

    def initial_hidden(self, aux_BTA: torch.Tensor, last_BTH: torch.Tensor | None = None) -> torch.Tensor:
        """Step-0 hidden input: the target's output after its final norm, as the engine hands it over."""
        if last_BTH is None:
            raise ValueError("the MTP module reads the target's last hidden state; the batch has none "
                             "(capture.teacher=topk stores no `last`: use capture.teacher=last)")
        return self.target_norm(last_BTH.to(self.lm_head.weight.dtype))

    def step(self, token_ids_BT, hidden_BTD, position_ids_BT, attend, depth: int = 0) -> torch.Tensor:
        emb = self.embed_tokens(token_ids_BT).to(hidden_BTD.dtype)
        if self.family.masks_position0:
            emb = torch.where(position_ids_BT[..., None] == 0, 0.0, emb)
        m = self.layer
        halves = [m.enorm(emb), m.hnorm(hidden_BTD)]
        x = m.eh_proj(torch.cat(halves[::-1] if self.family.hidden_first else halves, dim=-1))
        h = m.mtp_block(x, attention_mask=None, position_ids=position_ids_BT,
                        position_embeddings=self.rotary(x, position_ids_BT), draft_attend=attend)
        return m.post_norm(h) if self.family.carries_normed else h

    def logits(self, hidden_BTD: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.lm_head(hidden_BTD if self.family.carries_normed else self.layer.post_norm(hidden_BTD))

    def attention(self) -> NativeMTPHead:
        return self  # the drafting loops need only `expand_kv`

    def expand_kv(self, x_BKTE: torch.Tensor) -> torch.Tensor:
        """Keys or values of the K kv heads repeated for the N query heads (MLA: K = N)."""
        rep = self.num_heads // x_BKTE.shape[1]
        return x_BKTE.repeat_interleave(rep, dim=1) if rep > 1 else x_BKTE

    @torch.no_grad()
    def init_module(self, target_model) -> str:
        """The module's start: the MTP weights of the checkpoint the target was loaded from when it has them,
        else the target's last full-attention decoder layer as the block (norms at their start, a fresh eh_proj).
        Says which."""
        self.target_norm.load_state_dict(target_model.get_decoder().norm.state_dict())
        checkpoint = Path(target_model.config.name_or_path or "")
        prefixes = layer_prefixes(self.family, target_model.config.num_hidden_layers)
        if checkpoint.is_dir() and any(k.startswith(prefixes) for k in checkpoint_keys(checkpoint)):
            self.layer.load_state_dict(checkpoint_mtp_state(target_model, self.family, checkpoint))
            return f"the MTP weights of {checkpoint}"
        layers = target_model.get_decoder().layers
        full = [layer for layer in layers if getattr(layer, "layer_type", "full_attention") == "full_attention"]
        self.layer.mtp_block.load_state_dict(full[-1].state_dict())
        return "the target's last full-attention decoder layer (no MTP weights in its checkpoint)"


def layer_prefixes(family: MtpFamily, num_hidden_layers: int) -> tuple[str, str]:
    """The checkpoint prefixes of MTP layer 0: its own tensors', its block's."""
    return family.module_prefix.format(L=num_hidden_layers), family.block_prefix.format(L=num_hidden_layers)


def checkpoint_keys(directory: Path) -> list[str]:
    """Every tensor name a checkpoint dir serves: its index's, else those of its safetensors files."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text())["weight_map"])
    keys = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            keys += list(f.keys())
    return keys


def model_conversions(model) -> list:
    """The conversions transformers loaded `model` with, or for a model built in memory the ones it writes a
    checkpoint with (`revert_weight_conversion`'s choice, which our MTP export goes through)."""
    loaded = getattr(model, "_weight_conversions", None)
    if loaded is not None:
        return loaded
    return [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]


def checkpoint_mtp_state(target_model, family: MtpFamily, checkpoint: Path) -> dict[str, torch.Tensor]:
    """Layer 0 of the MTP weights in `checkpoint` (a dir of `target_model`'s family) as `MtpLayer` keys, the block
    converted by transformers exactly as the checkpoint's own layers are (it raises on any missing weight). A
    layer's copies of the embedding and lm_head are not read: the engine drafts with the target's."""
    own_prefix, block_prefix = layer_prefixes(family, target_model.config.num_hidden_layers)
    skip = r"(?!embed_tokens\.|shared_head\.head\.)"
    pattern = re.compile("|".join(f"^{re.escape(p)}{skip}" for p in {own_prefix, block_prefix}))
    own = [WeightRenaming(re.escape(own_prefix + theirs), "layers.0." + ours)
           for ours, theirs in family.module_keys.items()]

    class CheckpointMtp(MtpModel):
        @staticmethod
        def get_mtp_weights_regex(main_model):  # transformers knows only the released models' layer numbers
            return pattern

        def get_weight_conversions(self, main_model):  # the layer's own keys first, then its block's
            block = WeightRenaming(re.escape(block_prefix), "layers.0.mtp_block.")
            return [*own, block, *model_conversions(main_model)]

    config = target_model.config
    target_model.config = with_one_mtp_layer(config)  # what transformers' MtpModel reads of the main model
    target_model.config.name_or_path = str(checkpoint)
    target_model.config.dtype = next(target_model.parameters()).dtype  # a config built in memory names none
    try:
        mtp = CheckpointMtp.from_pretrained(target_model)
    finally:
        target_model.config = config
    return {k.removeprefix("layers.0."): v for k, v in mtp.state_dict().items() if k.startswith("layers.0.")}
