"""A head's own checkpoint format: `head.safetensors` + `head_config.json` + `checksums.json`, verified on every
load, so a corrupted head is never evaluated or exported.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdistill.heads.build import HEADS
from specdistill.io import (
    CorruptFile,
    embedding_fingerprint,
    save_tensors,
    verify_checksums,
    write_checksums,
    write_json,
)

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"


class HeadMismatch(ValueError):
    """A head was trained for another target than the one it is asked to draft for."""


def check_head_fits_target(head, target, where: str | Path) -> None:
    """Raise HeadMismatch, naming both sides, when the head in `where` was trained for another target than `target`
    (another vocabulary, hidden size, depth, capture layers or embedding): such a head would yield a
    valid-looking report of nonsense, or a shape error after the plain decoding already ran."""
    c = head.config
    sides = [("vocabulary", c.vocab_size, target.vocab_size),
             ("hidden size", c.target_hidden_size, target.hidden_size),
             ("decoder layers", c.target_num_layers, target.config.num_hidden_layers)]
    if c.kind in ("eagle3", "dflash"):  # an MTP head reads only the last hidden state
        sides.append(("capture layers", list(c.aux_layer_ids), list(target.layer_ids)))
    if c.target_embedding is not None:
        sides.append(("input embedding fingerprint", c.target_embedding[:12],
                      embedding_fingerprint(target.model.get_input_embeddings().weight)[:12]))
    wrong = [f"{name}: the head's {ours}, the target's {theirs}" for name, ours, theirs in sides if ours != theirs]
    if wrong:
        raise HeadMismatch(f"{where}: the head was trained for target `{c.target_name or 'unrecorded'}`, which does not "
                           f"fit target `{target.name}` ({'; '.join(wrong)}); evaluate or export it with the target "
                           "it was trained for, or train a head for this one")


def save_head(head, directory: str | Path) -> None:
    directory = Path(directory)
    save_tensors(
        directory / HEAD_WEIGHTS, {k: v.detach().cpu() for k, v in head.trainable_state_dict().items()}
    )
    write_json(directory / HEAD_CONFIG, head.config.to_dict())
    write_checksums(directory)


def load_head(directory: str | Path, device: str | torch.device = "cpu"):
    """The head saved in `directory`, its files checked against their checksums first."""
    directory = Path(directory)
    if not (directory / HEAD_CONFIG).exists():
        raise FileNotFoundError(f"{directory}: no {HEAD_CONFIG}; expected a head checkpoint directory")
    verify_checksums(directory)
    weights = directory / HEAD_WEIGHTS
    try:
        d = json.loads((directory / HEAD_CONFIG).read_text())
        config = HEADS[d.get("kind", "eagle3")][0].from_dict(d)
    except (ValueError, KeyError, TypeError) as err:  # bad UTF-8, bad JSON, missing or unexpected fields
        raise CorruptFile(f"{directory / HEAD_CONFIG}: not a head config ({err!r})") from err
    try:
        state = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error types for a truncated or garbled file
        raise CorruptFile(f"{weights}: unreadable ({err})") from err
    return head_from_state(config, state, str(weights)).to(device)


def head_from_state(config, state: dict[str, torch.Tensor], source: str):
    """A head of `config` holding `state` (rotary tables are rebuilt, not loaded); `source` names it in errors."""
    head = HEADS[config.kind][1](config)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(f"{source}: missing keys {missing}, unexpected keys {unexpected}")
    return head
