"""Training samples and how they become TTT batches.

Two sources hand out the same per-sample tensors (input_ids, loss_mask, aux, and `last` or the
top-k teacher): `StoreSource` reads the offline feature store, `OnlineSource` runs the frozen target on
the prepared samples batch by batch (capture.mode=online) through the same `capture_batch` the
offline capture writes to disk.

Two batchings, chosen by `train.batching`: `bucket` (one sample per row, rows of similar length,
right-padded) and `pack` (several documents concatenated in one row up to `batch_tokens`; attention
and positions are per document, see `ttt.py`). Both are plans of rows of sample ids, deterministic
per seed and epoch, so a resumed run replays the same order.

Shapes: B rows, T tokens, A aux features, H target hidden, K teacher top-k.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from specdistill.capture.online import capture_batch
from specdistill.capture.run import load_samples, right_padded
from specdistill.capture.store import FeatureStore
from specdistill.target import Target
from specdistill.target_runner import TargetRunner
from specdistill.train.schedule import bucketed_batches
from specdistill.train.ttt import TTTBatch

TEACHER_KEYS = ("last", "topk_logprobs", "topk_ids")
Plan = list[list[list[int]]]  # batches -> rows -> sample ids


class StoreSource:
    """Samples from a finished offline feature store."""

    def __init__(self, store: FeatureStore):
        self.store = store
        self.lengths = [int(n) for n in store.lengths]

    def samples(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        return [self.store.sample(i) for i in ids]


class OnlineSource:
    """Samples whose features the frozen target computes on demand, one right-padded forward per call."""

    def __init__(self, samples_dir: Path, target: Target, teacher: str, teacher_topk: int, device):
        self.dataset = load_samples(samples_dir)
        self.lengths = [len(ids) for ids in self.dataset["input_ids"]]
        self.runner = TargetRunner(target)
        self.pad_id = target.tokenizer.pad_token_id or 0
        self.teacher, self.teacher_topk, self.device = teacher, teacher_topk, device
        if target.model.device != torch.device(device):
            target.model.to(device)

    def samples(self, ids: list[int]) -> list[dict[str, torch.Tensor]]:
        rows = self.dataset[ids]
        input_ids_BT, attention_mask_BT = right_padded(rows["input_ids"], self.pad_id)
        feats = capture_batch(self.runner, input_ids_BT.to(self.device), attention_mask_BT.to(self.device),
                              self.teacher, self.teacher_topk)
        out = []
        for b, i in enumerate(ids):
            n = self.lengths[i]
            out.append({"input_ids": input_ids_BT[b, :n], "loss_mask": torch.tensor(rows["loss_mask"][b]),
                        **{k: v[b, :n].clone() for k, v in feats.items()}})
        return out


def bucket_plan(lengths: dict[int, int], batch_tokens: int, seed: int, epoch: int) -> Plan:
    """Length-bucketed batches, one sample per row."""
    return [[[i] for i in batch] for batch in bucketed_batches(lengths, batch_tokens, seed, epoch)]


def pack_plan(lengths: dict[int, int], batch_tokens: int, seed: int, epoch: int) -> Plan:
    """One packed row per batch: documents placed first-fit (longest first) into rows of <= batch_tokens.

    A document longer than batch_tokens gets a row of its own. Rows are shuffled per seed and epoch.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    ids = list(lengths)
    rng.shuffle(ids)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(ids, key=lambda i: -lengths[i]):
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([])
            room.append(batch_tokens)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= lengths[i]
    rng.shuffle(rows)
    return [[row] for row in rows]


PLANS = {"bucket": bucket_plan, "pack": pack_plan}


def holdout_split(n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sample ids of a store of `n` samples: a seeded `share` held out, none below 20 samples."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_hold = int(round(share * n)) if n >= 20 else 0
    return sorted(order[n_hold:]), sorted(order[:n_hold])


def collate(rows: list[list[dict[str, torch.Tensor]]], device, packed: bool) -> tuple[TTTBatch, dict]:
    """Rows of samples -> a right-padded TTTBatch and the teacher tensors (`last` or `topk_*`).

    A row's samples are concatenated; with `packed`, the batch carries document numbers and positions
    that restart per document (a row of one sample then equals the unpacked batch)."""
    T = max(sum(len(s["input_ids"]) for s in row) for row in rows)
    B = len(rows)
    first = rows[0][0]
    input_ids = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.long)
    doc = torch.full((B, T), -1, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, first["aux"].shape[-1], dtype=torch.float32)
    teacher = {key: torch.zeros(B, T, first[key].shape[-1], dtype=torch.long if key == "topk_ids" else torch.float32)
               for key in TEACHER_KEYS if key in first}
    for b, row in enumerate(rows):
        start = 0
        for d, s in enumerate(row):
            n = len(s["input_ids"])
            span = slice(start, start + n)
            input_ids[b, span] = s["input_ids"].long()
            loss_mask[b, span] = s["loss_mask"].long()
            doc[b, span] = d
            positions[b, span] = torch.arange(n)
            aux[b, span] = s["aux"].float()
            for key, t in teacher.items():
                t[b, span] = s[key].to(t.dtype)
            start += n
    batch = TTTBatch(input_ids.to(device), loss_mask.to(device), (doc >= 0).to(device), aux.to(device),
                     teacher["last"].to(device) if "last" in teacher else None,
                     doc.to(device) if packed else None, positions.to(device) if packed else None)
    return batch, {k: v.to(device) for k, v in teacher.items()}
