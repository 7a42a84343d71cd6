"""Draft heads and their own checkpoint format (`head.safetensors` + `head_config.json`).

The trainer and the drafter see a head only through: `initial_hidden`, `step`, `logits`,
`draft_to_target`, `init_from_target`, `trainable_state_dict`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdistill.config import HeadConfig
from specdistill.heads.eagle3 import Eagle3Config, Eagle3Head
from specdistill.heads.layers import HeadArch
from specdistill.heads.mtp import MTPConfig, MTPHead
from specdistill.io import save_tensors, write_json

HEADS = {"eagle3": (Eagle3Config, Eagle3Head), "mtp": (MTPConfig, MTPHead)}
HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"


def arch_from_target(target_config, head_cfg: HeadConfig) -> HeadArch:
    """The head's block mirrors one target layer unless the config overrides a dimension."""
    tc = target_config
    heads = head_cfg.num_attention_heads or tc.num_attention_heads
    hidden = head_cfg.hidden_size or tc.hidden_size
    rope = dict(
        getattr(tc, "rope_parameters", None)
        or {"rope_type": "default", "rope_theta": getattr(tc, "rope_theta", 10000.0)}
    )
    return HeadArch(
        hidden_size=hidden,
        intermediate_size=head_cfg.intermediate_size or tc.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=head_cfg.num_key_value_heads or tc.num_key_value_heads,
        head_dim=head_cfg.head_dim or getattr(tc, "head_dim", None) or hidden // heads,
        rms_norm_eps=float(tc.rms_norm_eps),
        max_position_embeddings=int(tc.max_position_embeddings),
        rope_parameters=rope,
    )


def build_head(head_cfg: HeadConfig, target, d2t: torch.Tensor, t2d: torch.Tensor):
    """A new head sized for `target`, with the target's embedding (and lm_head rows) copied in."""
    if head_cfg.kind not in HEADS:
        raise ValueError(
            f"config field `head.kind`: {head_cfg.kind!r} is not built yet; available: {list(HEADS)}"
        )
    config_cls, head_cls = HEADS[head_cfg.kind]
    tc = target.config
    extra = {"num_modules": head_cfg.mtp_num_modules} if head_cfg.kind == "mtp" else {}
    config = config_cls(
        arch=arch_from_target(tc, head_cfg),
        vocab_size=tc.vocab_size,
        draft_vocab_size=len(d2t),
        target_hidden_size=tc.hidden_size,
        aux_layer_ids=list(target.layer_ids),
        target_num_layers=tc.num_hidden_layers,
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


def save_head(head, directory: str | Path) -> None:
    directory = Path(directory)
    save_tensors(
        directory / HEAD_WEIGHTS, {k: v.detach().cpu() for k, v in head.trainable_state_dict().items()}
    )
    write_json(directory / HEAD_CONFIG, head.config.to_dict())


def load_head(directory: str | Path, device: str | torch.device = "cpu"):
    directory = Path(directory)
    if not (directory / HEAD_CONFIG).exists():
        raise FileNotFoundError(f"{directory}: no {HEAD_CONFIG}; expected a head checkpoint directory")
    d = json.loads((directory / HEAD_CONFIG).read_text())
    config = HEADS[d.get("kind", "eagle3")][0].from_dict(d)
    return head_from_state(config, load_file(str(directory / HEAD_WEIGHTS)), str(directory / HEAD_WEIGHTS)).to(device)


def head_from_state(config, state: dict[str, torch.Tensor], source: str):
    """A head of `config` holding `state` (rotary tables are rebuilt, not loaded); `source` names it in errors."""
    head = HEADS[config.kind][1](config)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"{source}: missing keys {missing}, unexpected keys {unexpected}")
    return head


def trained_head_dir(run_dir: str | Path) -> Path:
    """`ckpt/best/` if training kept one, else `ckpt/final/`: the head evaluate and export use."""
    for name in ("best", "final"):
        if (Path(run_dir) / "ckpt" / name / HEAD_CONFIG).exists():
            return Path(run_dir) / "ckpt" / name
    raise FileNotFoundError(f"{Path(run_dir) / 'ckpt'}: neither best/ nor final/ holds a head checkpoint; "
                            "run the train stage first")
