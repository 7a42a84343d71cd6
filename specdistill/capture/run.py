"""The capture stage: run the frozen target over the prepared samples and write the feature store.

Reads the prepared samples (HF dataset: input_ids, loss_mask), writes the feature store
(`RunLayout.features_dir`). Shards are planned from the data alone, so a killed run resumes with any number of ranks: rank r captures shards r, r + world, ...; rank 0 writes the one manifest after a barrier.
A finished store made with the same target, layers, dtype, teacher and data is kept, not redone.

Legend: B batch, T tokens (right-padded).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist
from tqdm import tqdm

from specdistill.capture.online import capture_batch
from specdistill.capture.shard_writer import ShardWriter, write_manifest
from specdistill.capture.store import (
    MANIFEST,
    STORE_DTYPES,
    FeatureStore,
    FeatureStoreError,
    mismatch,
    padded_batches,
    plan_shards,
)
from specdistill.config import CaptureConfig, RunConfig
from specdistill.distributed import join_launch
from specdistill.io import weights_fingerprint
from specdistill.layout import RunLayout
from specdistill.target import Target, computing_in, resolve_dtype
from specdistill.target_runner import TargetRunner

log = logging.getLogger(__name__)

COLUMNS = ("input_ids", "loss_mask")
SCAN_ROWS = 8192


class BadSamples(ValueError):
    """The prepared samples are missing or malformed; the message names the row and field."""


# ---------------------------------------------------------------- input


def load_samples(path: Path):
    """The prepared dataset, reduced to the two columns capture needs."""
    import datasets

    if not path.exists():
        raise BadSamples(f"{path}: no prepared samples; run the prepare stage first")
    ds = datasets.load_from_disk(str(path))
    if not isinstance(ds, datasets.Dataset):
        raise BadSamples(
            f"{path}: expected one dataset (datasets.Dataset.save_to_disk), found {type(ds).__name__}"
        )
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise BadSamples(
            f"{path}: missing column(s) {missing} (has {ds.column_names}); expected input_ids "
            "(list of int) and loss_mask (list of 0/1)"
        )
    return ds.select_columns(list(COLUMNS))


@dataclass
class SampleScan:
    lengths: list[int]
    fingerprint: str  # sha256 over every token id and loss-mask value, so changed data is never re-used


def _flat_values(table: pa.Table, name: str, where: Path, row0: int) -> tuple[np.ndarray, np.ndarray]:
    """(per-row lengths, all values flattened) of a list-of-int column, as int64."""
    column = table.column(name)
    is_list = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
    if not (is_list and pa.types.is_integer(column.type.value_type)):
        raise BadSamples(f"{where}: column `{name}` has type {column.type}, expected a list of integers")
    if column.null_count:
        raise BadSamples(f"{where}: column `{name}` has null rows among rows {row0}..{row0 + len(table) - 1}")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    return lengths, pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _row_of(flat_pos: int, lengths: np.ndarray, row0: int) -> int:
    return row0 + int(np.searchsorted(np.cumsum(lengths), flat_pos, side="right"))


def scan_samples(ds, where: Path, vocab_size: int) -> SampleScan:
    """One pass over the data: per-row lengths, checks (shape, id range, 0/1 mask), and a content hash."""
    digest = hashlib.sha256()
    lengths: list[int] = []
    row0 = 0
    for table in ds.with_format("arrow").iter(batch_size=SCAN_ROWS):
        ids_len, ids_N = _flat_values(table, "input_ids", where, row0)
        mask_len, mask_N = _flat_values(table, "loss_mask", where, row0)
        if (bad := np.flatnonzero(ids_len != mask_len)).size:
            r = int(bad[0])
            raise BadSamples(
                f"{where}: row {row0 + r}: loss_mask has {mask_len[r]} entries, input_ids {ids_len[r]}"
            )
        if (bad := np.flatnonzero(ids_len == 0)).size:
            raise BadSamples(f"{where}: row {row0 + int(bad[0])}: input_ids is empty")
        if (bad := np.flatnonzero((ids_N < 0) | (ids_N >= vocab_size))).size:
            raise BadSamples(
                f"{where}: row {_row_of(int(bad[0]), ids_len, row0)}: input_ids holds token "
                f"{ids_N[bad[0]]}, outside the target vocabulary [0, {vocab_size})"
            )
        if (bad := np.flatnonzero((mask_N != 0) & (mask_N != 1))).size:
            raise BadSamples(
                f"{where}: row {_row_of(int(bad[0]), ids_len, row0)}: loss_mask holds "
                f"{mask_N[bad[0]]}, expected 0 or 1"
            )
        for part in (ids_len, ids_N, mask_N.astype(np.uint8)):
            digest.update(part.tobytes())
        lengths.extend(ids_len.tolist())
        row0 += len(table)
    if not lengths:
        raise BadSamples(f"{where}: the dataset has no rows")
    return SampleScan(lengths, digest.hexdigest())


def store_header(target: Target, capture: CaptureConfig, data_fingerprint: str, compute_dtype: torch.dtype) -> dict:
    """Everything a store's contents depend on; a store whose header differs is captured again."""
    return {
        "target_name": target.name,
        "target_revision": target.revision,
        "target_fingerprint": weights_fingerprint(target.model),
        "target_dtype": str(compute_dtype).removeprefix("torch."),
        "layer_ids": [int(i) for i in target.layer_ids],
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "dtype": capture.dtype,
        "teacher": capture.teacher,
        "teacher_topk": capture.teacher_topk if capture.teacher == "topk" else None,
        "data_fingerprint": data_fingerprint,
        "shard_tokens": capture.shard_tokens,
    }


# ---------------------------------------------------------------- ranks


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _existing_store(out_dir: Path, header: dict) -> FeatureStore | None:
    if not (out_dir / MANIFEST).exists():
        return None
    try:
        store = FeatureStore(out_dir)
    except FeatureStoreError as err:
        log.warning("the feature store at %s is unusable (%s); capturing again", out_dir, err)
        return None
    reason = mismatch(store.manifest, header)
    if reason is not None:
        log.warning(
            "the feature store at %s was captured with other settings (%s); capturing again", out_dir, reason
        )
        return None
    try:
        store.verify()  # a complete store is re-used only when every shard still hashes as recorded
    except FeatureStoreError as err:
        log.warning("%s; recapturing the shards that differ from their records", err)
        return None
    return store


# ---------------------------------------------------------------- capture


def right_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_BT, attention_mask_BT), padded on the right to the longest sequence."""
    input_ids_BT = torch.full((len(sequences), max(map(len, sequences))), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros_like(input_ids_BT)
    for b, ids in enumerate(sequences):
        input_ids_BT[b, : len(ids)] = torch.tensor(ids)
        attention_mask_BT[b, : len(ids)] = 1
    return input_ids_BT, attention_mask_BT


def capture_shard(
    writer: ShardWriter,
    shard_id: int,
    members: list[int],
    ds,
    lengths: list[int],
    runner: TargetRunner,
    capture: CaptureConfig,
    device: torch.device,
    bar: tqdm,
) -> dict:
    """Forward one shard's samples in right-padded length batches and write the shard."""
    store_dtype = STORE_DTYPES[capture.dtype]
    pad_id = runner.target.tokenizer.pad_token_id or 0
    writer.begin(shard_id, members)
    for batch in padded_batches(members, lengths, capture.batch_tokens):
        rows = ds[batch]
        input_ids_BT, attention_mask_BT = right_padded(rows["input_ids"], pad_id)
        feats = capture_batch(
            runner, input_ids_BT.to(device), attention_mask_BT.to(device), capture.teacher, capture.teacher_topk
        )
        feats = {k: (v.to(store_dtype) if v.is_floating_point() else v).cpu() for k, v in feats.items()}
        for b, i in enumerate(batch):
            n = lengths[i]
            writer.add(
                {
                    "input_ids": input_ids_BT[b, :n].to(torch.int32),
                    "loss_mask": torch.tensor(rows["loss_mask"][b], dtype=torch.uint8),
                    **{k: v[b, :n] for k, v in feats.items()},
                }
            )
        bar.update(sum(lengths[i] for i in batch))
    return writer.finish()


def _summary(store: FeatureStore, skipped: bool) -> dict:
    return {
        "features": str(store.path),
        "samples": len(store),
        "tokens": store.num_tokens,
        "shards": len(store.shards),
        "bytes_per_token": round(store.bytes_per_token(), 1),
        "skipped": skipped,
    }


def run(cfg: RunConfig, layout: RunLayout, target) -> dict:
    """Capture features for every prepared sample (offline mode) into `layout.features_dir`; `target` is a
    pipeline.LazyTarget."""
    if cfg.capture.mode == "online":
        log.info("capture.mode=online: no feature store; the target runs inside training")
        return {"mode": "online", "skipped": True}
    out_dir = layout.features_dir
    rank, world, device = join_launch()
    where = layout.samples_dir
    ds = load_samples(where)
    loaded = target.get()
    scan = scan_samples(ds, where, loaded.vocab_size)
    compute_dtype = resolve_dtype(cfg.capture.target_dtype, device)
    header = store_header(loaded, cfg.capture, scan.fingerprint, compute_dtype)
    existing = _existing_store(out_dir, header)
    _barrier(world)
    if existing is not None:
        log.info(
            "capture: reusing the feature store at %s (%d samples): captured for these settings already",
            out_dir,
            len(existing),
        )
        return _summary(existing, skipped=True)

    plan = plan_shards(scan.lengths, cfg.capture.shard_tokens)
    writer = ShardWriter(out_dir, header, rank)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        writer.clear_stale(len(plan))
    _barrier(world)
    assigned = range(rank, len(plan), world)
    done = writer.completed(assigned, check_hash=True)
    mine = [k for k in assigned if k not in done]
    writer.discard_partial(mine)
    log.info(
        "capturing %d samples (%d tokens) into %d shards at %s; rank %d of %d: %d shards to write, "
        "%d already complete",
        len(scan.lengths),
        sum(scan.lengths),
        len(plan),
        out_dir,
        rank,
        world,
        len(mine),
        len(done),
    )
    if loaded.model.device != device:
        loaded.model.to(device)
    runner = TargetRunner(computing_in(loaded, cfg.capture.target_dtype))  # on `device` now: the header's dtype
    todo_tokens = sum(scan.lengths[i] for k in mine for i in plan[k])
    with tqdm(
        total=todo_tokens, unit="tok", unit_scale=True, desc=f"capture rank {rank}", position=rank
    ) as bar:
        for k in mine:
            capture_shard(writer, k, plan[k], ds, scan.lengths, runner, cfg.capture, device, bar)
    _barrier(world)
    if rank == 0:
        records = writer.completed()
        missing = [k for k in range(len(plan)) if k not in records]
        if missing:
            raise RuntimeError(f"{out_dir}: shards {missing} are missing after capture (did a rank fail?)")
        path = write_manifest(out_dir, header, [records[k] for k in range(len(plan))])
        log.info("wrote %s (%d shards)", path, len(plan))
    _barrier(world)
    store = FeatureStore(out_dir)
    log.info(
        "feature store ready at %s: %d samples, %d tokens, %.0f bytes/token",
        out_dir,
        len(store),
        store.num_tokens,
        store.bytes_per_token(),
    )
    return _summary(store, skipped=False)
