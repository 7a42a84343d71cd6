"""What a stage consumed, recorded beside what it wrote, so that work kept for other inputs is never resumed.

A fingerprint is a flat dict: the hashes of the stage's inputs (`input:<name>`) and the config fields that change
its output (`train.lr`, ...). A stage compares the one it recorded with the one it would record now and, on any
difference, refuses with the fields that changed and the two ways out: a new run name, or `restart=true`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from specdistill.cache import content_key
from specdistill.capture.store import HEADER_KEYS, MANIFEST, FeatureStore
from specdistill.config import CaptureConfig, HeadConfig, RunConfig, TrainConfig
from specdistill.io import sha256_file, weights_fingerprint
from specdistill.layout import RunLayout
from specdistill.target import Target

log = logging.getLogger(__name__)
# train fields a resumed run may change: they decide when to save or evaluate, not the weights trained
RESUME_SAFE = ("ckpt_every", "keep_last", "eval_every", "max_bad_steps", "served_vocab_size")
TRAINED_ON = "trained_on.json"  # in ckpt/best/ and ckpt/final/: the fingerprint of the run that trained the head


class StaleRun(ValueError):
    """A run directory holds work done for other inputs or settings than this run's."""


def config_fields(node, prefix: str, skip: tuple[str, ...] = ()) -> dict:
    """A config dataclass as `{"<prefix>.<field>": value}`, nested dataclasses flattened, `skip` fields left out."""
    out = {}
    for f in dataclasses.fields(node):
        name, value = f"{prefix}.{f.name}", getattr(node, f.name)
        if f.name in skip:
            continue
        if dataclasses.is_dataclass(value):
            out.update(config_fields(value, name))
        else:
            out[name] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def changes(recorded: dict, current: dict) -> list[str]:
    """Each key whose value differs, as `key: old -> new` (hashes shortened, `(none)` where a side lacks it)."""
    def shown(side: dict, key: str) -> str:
        if key not in side:
            return "(none)"
        value = side[key]
        return f"{value[:12]}..." if isinstance(value, str) and len(value) >= 32 else repr(value)

    return [f"{key}: {shown(recorded, key)} -> {shown(current, key)}" for key in sorted(recorded.keys() | current.keys())
            if key not in recorded or key not in current or recorded[key] != current[key]]


def check_same(what: Path, recorded: dict, current: dict, name: str) -> None:
    """Raise StaleRun when `what` (kept work of run `name`) was made from another fingerprint than `current`. A
    train or head field that `recorded` lacks was added to the schema since, and is read at its default: what a new
    field defaults to is what runs did before it existed."""
    added_since = {k: v for k, v in schema_defaults().items() if k not in recorded}
    changed = changes({**added_since, **recorded}, current)
    if changed:
        raise StaleRun(f"{what} was made from other inputs or settings than this run's ({'; '.join(changed)}); "
                       f"start a new run with name=<another name than {name}>, or pass restart=true to discard this run's "
                       "training checkpoints and train anew")


def schema_defaults() -> dict:
    """The train and head fields a fingerprint records, at their defaults."""
    return {**config_fields(TrainConfig(), "train", skip=RESUME_SAFE), **config_fields(HeadConfig(), "head")}


def train_fingerprint(train: TrainConfig, head: HeadConfig, capture: CaptureConfig, seed: int, layout: RunLayout,
                      target: Target | None) -> dict:
    """What the trained weights depend on: the keys of the store entries trained on (the data and capture settings),
    hashes of the features, the draft vocabulary and the target's weights, and the fields of `train` and `head`
    that change the weights. An input file that is not there (`target` None, a feature store deleted after
    training) is left out."""
    out = {**config_fields(train, "train", skip=RESUME_SAFE), **config_fields(head, "head"), "seed": seed,
           "input:data_key": layout.data_key}
    if capture.mode == "online":
        out["input:features"] = content_key(layout.data_key, config_fields(capture, "capture"))
    else:
        out["input:features_key"] = layout.features_key
        if (layout.features_dir / MANIFEST).exists():
            store = FeatureStore(layout.features_dir)
            out["input:features"] = content_key({k: store.manifest[k] for k in HEADER_KEYS},
                                                [s["sha256"] for s in store.shards])
    if layout.vocab_file.exists():
        out["input:draft_vocab"] = sha256_file(layout.vocab_file)
    if target is not None:
        out["input:target"] = weights_fingerprint(target.model)
    return out


def check_head_is_current(head_dir: Path, cfg: RunConfig, layout: RunLayout, target: Target | None = None) -> None:
    """Raise StaleRun when the head in `head_dir` (best/ or final/) was trained on other inputs or settings than
    this run's: what evaluate and export must check before they use it, since `stages=[evaluate]` alone would
    otherwise score a head left from before the data changed. Input files no longer there are not compared."""
    if not (head_dir / TRAINED_ON).exists():
        raise StaleRun(f"{head_dir}: no {TRAINED_ON}, so what it was trained on is unknown; run the train stage")
    recorded = json.loads((head_dir / TRAINED_ON).read_text())
    current = train_fingerprint(cfg.train, cfg.head, cfg.capture, cfg.seed, layout, target)
    kept = {k: v for k, v in recorded.items() if k in current or not k.startswith("input:")}  # inputs still here
    check_same(head_dir, kept, current, cfg.name)
