"""Building a draft head for a target: EAGLE-3, MTP, or the target's own MTP layer, sized from the target's config.

The trainer and the drafter see a head only through: `initial_hidden`, `step`, `logits`, `draft_to_target`,
`init_from_target`, `trainable_state_dict`.
"""

from __future__ import annotations

import logging

import torch

from specdistill.config import HeadConfig
from specdistill.heads.dflash import DFlashConfig, DFlashHead
from specdistill.heads.eagle3 import Eagle3Config, Eagle3Head
from specdistill.heads.layers import HeadArch
from specdistill.heads.mtp import MTPConfig, MTPHead
from specdistill.heads.native_mtp import NativeMTPConfig, NativeMTPHead, declares_mtp
from specdistill.io import embedding_fingerprint

log = logging.getLogger(__name__)
HEADS = {"eagle3": (Eagle3Config, Eagle3Head), "mtp": (MTPConfig, MTPHead),
         "native_mtp": (NativeMTPConfig, NativeMTPHead), "dflash": (DFlashConfig, DFlashHead)}


def arch_from_target(target_config, head_cfg: HeadConfig) -> HeadArch:
    """The head's block mirrors one target layer unless the config overrides a dimension."""
    tc = target_config
    heads = head_cfg.num_attention_heads or tc.num_attention_heads
    hidden = head_cfg.hidden_size or tc.hidden_size
    return HeadArch(
        hidden_size=hidden,
        intermediate_size=head_cfg.intermediate_size or tc.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=head_cfg.num_key_value_heads or tc.num_key_value_heads,
        head_dim=head_cfg.head_dim or getattr(tc, "head_dim", None) or hidden // heads,
        rms_norm_eps=float(tc.rms_norm_eps),
        max_position_embeddings=int(tc.max_position_embeddings),
        rope_parameters=target_rope(tc),
    )


def target_rope(target_config) -> dict:
    """The target's `rope_parameters` (transformers >= 5), which the head's RoPE must equal. A config without
    them (transformers 4.x spells RoPE `rope_theta` + `rope_scaling`, and its rotary ignores
    `rope_parameters`) is refused rather than read as theta 10000, which would train a head at wrong positions.
    A target with RoPE per layer type (Gemma 3: local and global) gives the head its global layers' RoPE: the
    head attends over the whole context, as those layers do."""
    rope = getattr(target_config, "rope_parameters", None)
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    if not isinstance(rope, dict) or "rope_theta" not in rope or "rope_type" not in rope:
        raise ValueError(
            f"target config {type(target_config).__name__}: `rope_parameters` = {rope!r}, expected one dict with "
            "`rope_type` and `rope_theta` (a transformers >= 5 field), or one per layer type with `full_attention`"
        )
    return dict(rope)


def build_head(head_cfg: HeadConfig, target, d2t: torch.Tensor, t2d: torch.Tensor, block_size: int | None = None):
    """A new head sized for `target`, with the target's embedding (and lm_head rows) copied in; a DFlash head drafts
    blocks of `block_size` slots (the bonus and the masks: `train.ttt_steps + 1`), which only it needs."""
    if head_cfg.kind not in HEADS:
        raise ValueError(
            f"config field `head.kind`: {head_cfg.kind!r} is not built yet; available: {list(HEADS)}"
        )
    if head_cfg.kind == "dflash" and block_size is None:
        raise ValueError("a DFlash head needs its block size (train.ttt_steps + 1): pass block_size to build_head")
    tc = target.config
    if head_cfg.kind == "mtp" and declares_mtp(tc):
        return build_native_mtp(target)
    config_cls, head_cls = HEADS[head_cfg.kind]
    extra = {
        "mtp": lambda: {"num_modules": head_cfg.mtp_num_modules},
        "dflash": lambda: {"num_layers": head_cfg.num_layers, "block_size": block_size,
                           "mask_token_id": mask_token_id(head_cfg, target)},
        "eagle3": lambda: {"fc_norm": head_cfg.fc_norm, "parallel_drafting": head_cfg.parallel_drafting,
                           "mask_token_id": mask_token_id(head_cfg, target) if head_cfg.parallel_drafting else None},
    }[head_cfg.kind]()
    config = config_cls(
        arch=arch_from_target(tc, head_cfg),
        vocab_size=tc.vocab_size,
        draft_vocab_size=len(d2t),
        target_hidden_size=tc.hidden_size,
        aux_layer_ids=list(target.layer_ids),
        target_num_layers=tc.num_hidden_layers,
        target_name=target.name,
        target_embedding=embedding_fingerprint(target.model.get_input_embeddings().weight),
        **extra,
    )
    head = head_cls(config)
    same_width = config.arch.hidden_size == tc.hidden_size  # else the head learns its own embedding
    embed = target.model.get_input_embeddings().weight.float() if same_width else None
    lm_head = (
        target.model.get_output_embeddings().weight.float()
        if same_width and head_cfg.init_lm_head_from_target
        else None
    )
    head.init_from_target(embed, lm_head, d2t, t2d)
    if head_cfg.freeze_lm_head:
        if lm_head is None:
            raise ValueError(f"config field `head.freeze_lm_head`: the head is {config.arch.hidden_size} wide and the "
                             f"target {tc.hidden_size}, so there are no target rows to freeze it at: set "
                             "head.freeze_lm_head=false to train the head's own")
        head.lm_head.weight.requires_grad_(False)
    return head


def mask_token_id(head_cfg: HeadConfig, target) -> int:
    """The mask slots' token (P-EAGLE, DFlash): `head.mask_token_id`, else the tokenizer's mask token, else its first unused embedding
    row, else pad, else eos (speculators' order, so a head trained by either picks the same token)."""
    vocab = target.config.vocab_size
    if head_cfg.mask_token_id is not None:
        if head_cfg.mask_token_id >= vocab:
            raise ValueError(f"config field `head.mask_token_id`: {head_cfg.mask_token_id} is not below the target's "
                             f"vocabulary size {vocab}")
        return head_cfg.mask_token_id
    tok = target.tokenizer
    if tok is None:
        raise ValueError("config field `head.mask_token_id`: the target has no tokenizer to pick a mask token from; "
                         "set head.mask_token_id")
    unused = len(tok) if len(tok) < vocab else None
    for found in (tok.mask_token_id, unused, tok.pad_token_id, tok.eos_token_id):
        if found is not None:
            log.info("mask token: %d (%r)", found, tok.convert_ids_to_tokens(found) if found < len(tok) else
                     "an unused embedding row")
            return int(found)
    raise ValueError("config field `head.mask_token_id`: the tokenizer has no mask, pad or eos token and no unused "
                     "embedding row; set head.mask_token_id")


def build_native_mtp(target) -> NativeMTPHead:
    """The target's own MTP module (its config declares MTP layers), started from the checkpoint's MTP weights
    when it has them, drafting over the full vocabulary with the target's frozen embedding and lm_head."""
    tc = target.config
    vocab = tc.vocab_size
    head = NativeMTPHead(NativeMTPConfig(
        target_config=tc.to_dict() | {"architectures": tc.architectures or [type(target.model).__name__]},
        vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=tc.hidden_size,
        aux_layer_ids=list(target.layer_ids), target_num_layers=tc.num_hidden_layers, target_name=target.name,
        target_embedding=embedding_fingerprint(target.model.get_input_embeddings().weight)))
    model = target.model
    head.init_from_target(model.get_input_embeddings().weight.float(), model.get_output_embeddings().weight.float(),
                          torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    log.info("MTP head: %s's own MTP module, started from %s", head.config.target_config["architectures"][0],
             head.init_module(model))
    return head
