"""The offline feature store: safetensors shards + one manifest, and its streaming reader (the resumable writer
is `shard_writer.py`).

Layout of a store directory:

    shard-00000.safetensors   input_ids [T] int32, loss_mask [T] uint8, offsets [S+1] int64,
                              aux [T, A] and last [T, H] in the store dtype, or instead of `last`
                              topk_logprobs [T, K] (store dtype) and topk_ids [T, K] int32
    progress/shard-00000.json one record per complete shard (written after its shard), for resume
    manifest.json             the header (target, layers, dtype, teacher, data fingerprint) and per
                              shard: file, sha256, bytes, samples, tokens, lengths, sample_indices;
                              written last, atomically: a store without it is unfinished

Shard numbers are global, so ranks that write different shards never collide on a name.

Legend: T tokens in a shard, S samples in a shard, H target hidden size, A = len(layer_ids) * H,
K teacher top-k.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load

from specdistill.io import sha256_file

log = logging.getLogger(__name__)

FORMAT = "specdistill-features/1"
MANIFEST = "manifest.json"
PROGRESS_DIR = "progress"
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# header fields that decide whether a store can stand in for a fresh capture
HEADER_KEYS = (
    "target_name",
    "target_revision",
    "target_fingerprint",
    "target_dtype",
    "layer_ids",
    "hidden_size",
    "vocab_size",
    "dtype",
    "teacher",
    "teacher_topk",
    "data_fingerprint",
    "shard_tokens",
)


class FeatureStoreError(ValueError):
    """A store is missing, unfinished, corrupted or captured for something else; the message says which."""


def shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.safetensors"


def mismatch(found: dict, wanted: dict) -> str | None:
    """The first field where `found` differs from `wanted` (only the fields `wanted` names), or None."""
    for key, value in wanted.items():
        if found.get(key) != value:
            return f"{key}: the store has {found.get(key)!r}, wanted {value!r}"
    return None


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[list[int]]:
    """Sample indices per shard: longest first (an out-of-memory batch shows up at once, and samples of
    similar length share a forward with little padding), cut greedily at `shard_tokens`."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shards: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        if current and tokens + lengths[i] > shard_tokens:
            shards.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        shards.append(current)
    return shards


# ---------------------------------------------------------------- reading


class FeatureStore:
    """Read-only view of a finished store: random access to samples, or streaming one shard at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.exists():
            raise FeatureStoreError(
                f"{self.path}: no {MANIFEST} (the capture did not finish, or this is not a "
                "feature store); run the capture stage"
            )
        self.manifest: dict = json.loads(manifest_path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise FeatureStoreError(
                f"{manifest_path}: format {self.manifest.get('format')!r}, expected {FORMAT!r}"
            )
        self.shards: list[dict] = self.manifest["shards"]
        self._starts = [0]
        for shard in self.shards:
            self._starts.append(self._starts[-1] + shard["samples"])
        self.lengths: list[int] = [n for shard in self.shards for n in shard["lengths"]]
        self.source_indices: list[int] = [i for shard in self.shards for i in shard["sample_indices"]]
        self._verified: set[int] = set()  # shards whose sha256 matched the manifest (each is hashed once)
        self._check_sizes()

    def __len__(self) -> int:
        return self._starts[-1]

    @property
    def num_tokens(self) -> int:
        return self.manifest["num_tokens"]

    @property
    def teacher_keys(self) -> tuple[str, ...]:
        return ("last",) if self.manifest["teacher"] == "last" else ("topk_logprobs", "topk_ids")

    def _check_sizes(self) -> None:
        """Cheap check on open: every shard is present at its recorded size (verify() hashes them)."""
        for shard in self.shards:
            path = self.path / shard["file"]
            if not path.exists():
                raise FeatureStoreError(f"{path}: shard listed in the manifest is missing")
            size = path.stat().st_size
            if size != shard["bytes"]:
                raise FeatureStoreError(
                    f"{path}: {size} bytes, the manifest records {shard['bytes']} "
                    "(truncated or rewritten); recapture"
                )

    def shard_members(self, k: int) -> range:
        """Store sample indices held by the k-th shard."""
        return range(self._starts[k], self._starts[k + 1])

    def locate(self, i: int) -> tuple[int, int]:
        """Store sample index -> (shard position, index within that shard)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        k = bisect.bisect_right(self._starts, i) - 1
        return k, i - self._starts[k]

    def _expected_shapes(self, shard: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        m = self.manifest
        tokens, dtype = shard["tokens"], STORE_DTYPES[m["dtype"]]
        shapes = {
            "input_ids": ((tokens,), torch.int32),
            "loss_mask": ((tokens,), torch.uint8),
            "offsets": ((shard["samples"] + 1,), torch.int64),
            "aux": ((tokens, len(m["layer_ids"]) * m["hidden_size"]), dtype),
        }
        if m["teacher"] == "last":
            shapes["last"] = ((tokens, m["hidden_size"]), dtype)
        else:
            shapes["topk_logprobs"] = ((tokens, m["teacher_topk"]), dtype)
            shapes["topk_ids"] = ((tokens, m["teacher_topk"]), torch.int32)
        return shapes

    def _check_shapes(self, shard: dict, tensors: dict[str, torch.Tensor]) -> None:
        where = self.path / shard["file"]
        expected = self._expected_shapes(shard)
        if set(tensors) != set(expected):
            raise FeatureStoreError(f"{where}: tensors {sorted(tensors)}, expected {sorted(expected)}")
        for key, (shape, dtype) in expected.items():
            if tuple(tensors[key].shape) != shape or tensors[key].dtype != dtype:
                raise FeatureStoreError(
                    f"{where}: `{key}` is {tuple(tensors[key].shape)} {tensors[key].dtype}, "
                    f"expected {shape} {dtype}"
                )
        lengths = torch.tensor(shard["lengths"], dtype=torch.int64)
        if not torch.equal(tensors["offsets"].diff(), lengths) or int(tensors["offsets"][0]) != 0:
            raise FeatureStoreError(f"{where}: `offsets` disagree with the sample lengths in the manifest")

    def _check_hash(self, k: int, data: bytes | None = None) -> None:
        """The k-th shard's sha256 (of `data`, its bytes when already read) against the manifest's, once per
        store: a flipped byte is never trained on."""
        if k in self._verified:
            return
        shard = self.shards[k]
        path = self.path / shard["file"]
        digest = hashlib.sha256(data).hexdigest() if data is not None else sha256_file(path)
        if digest != shard["sha256"]:
            raise FeatureStoreError(
                f"{path}: sha256 {digest[:12]}..., the manifest records {shard['sha256'][:12]}... (corrupted or "
                "rewritten); run the capture stage again (stages=[capture]), which recaptures that shard"
            )
        self._verified.add(k)

    def load_shard(self, k: int) -> dict[str, torch.Tensor]:
        """All tensors of the k-th shard, hashed while read and shape-checked; a bad file is named in the error."""
        shard = self.shards[k]
        path = self.path / shard["file"]
        data = path.read_bytes()
        self._check_hash(k, data)
        try:
            tensors = load(data)
        except Exception as err:
            raise FeatureStoreError(f"{path}: unreadable shard ({err}); recapture") from err
        self._check_shapes(shard, tensors)
        return tensors

    @staticmethod
    def _slice(tensors: dict[str, torch.Tensor], j: int) -> dict[str, torch.Tensor]:
        a, b = int(tensors["offsets"][j]), int(tensors["offsets"][j + 1])
        return {key: t[a:b] for key, t in tensors.items() if key != "offsets"}

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        """Per-token tensors of store sample i, read from its shard without loading the rest of it."""
        k, j = self.locate(i)
        path = self.path / self.shards[k]["file"]
        self._check_hash(k)
        try:
            with safe_open(str(path), framework="pt") as f:
                offsets = f.get_tensor("offsets")
                a, b = int(offsets[j]), int(offsets[j + 1])
                return {key: f.get_slice(key)[a:b] for key in f.keys() if key != "offsets"}
        except Exception as err:
            raise FeatureStoreError(f"{path}: unreadable shard ({err}); recapture") from err

    def iter_samples(self, indices: Iterable[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield (index, sample) for `indices`, shard by shard (shards in order of first appearance, samples
        in the given order within a shard), so each shard is read once. Samples are views into the shard."""
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for i in indices:
            k, j = self.locate(i)
            by_shard.setdefault(k, []).append((i, j))
        for k, members in by_shard.items():
            tensors = self.load_shard(k)
            for i, j in members:
                yield i, self._slice(tensors, j)

    def verify(self) -> None:
        """Hash and shape-check every shard; the first bad one is named in the error."""
        self._check_sizes()
        for k in range(len(self.shards)):
            self.load_shard(k)
        log.info(
            "verified %d shards (%d samples, %d tokens) in %s",
            len(self.shards),
            len(self),
            self.num_tokens,
            self.path,
        )

    def check_compatible(
        self,
        target_name: str,
        layer_ids: Sequence[int],
        hidden_size: int,
        teacher: str,
        *,
        teacher_topk: int | None = None,
        target_revision: str | None = None,
    ) -> None:
        """Refuse a store captured for another target, layer set, hidden size or teacher."""
        wanted = {
            "target_name": target_name,
            "layer_ids": [int(i) for i in layer_ids],
            "hidden_size": int(hidden_size),
            "teacher": teacher,
        }
        if teacher_topk is not None:
            wanted["teacher_topk"] = teacher_topk
        if target_revision is not None:
            wanted["target_revision"] = target_revision
        reason = mismatch(self.manifest, wanted)
        if reason is not None:
            raise FeatureStoreError(
                f"{self.path}: captured for something else ({reason}); recapture with "
                "stages=[capture] or point training at a matching store"
            )

    def bytes_per_token(self) -> float:
        return sum(s["bytes"] for s in self.shards) / max(self.num_tokens, 1)


# ---------------------------------------------------------------- training order


def shuffled_order(store: FeatureStore, seed: int, epoch: int = 0) -> list[int]:
    """A fresh order per epoch that still reads each shard once: shards shuffled, samples shuffled inside."""
    rng = random.Random(seed * 1_000_003 + epoch)
    shard_ids = list(range(len(store.shards)))
    rng.shuffle(shard_ids)
    order: list[int] = []
    for k in shard_ids:
        members = list(store.shard_members(k))
        rng.shuffle(members)
        order.extend(members)
    return order


def padded_batches(indices: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Cut `indices` (longest first) into consecutive batches with count * longest <= batch_tokens, so a
    right-padded batch stays within the token budget; a longer sample forms a batch of its own."""
    batches: list[list[int]] = []
    for i in indices:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def length_batches(store: FeatureStore, batch_tokens: int, seed: int, epoch: int = 0) -> list[list[int]]:
    """Length-bucketed batches (count * longest <= batch_tokens, so padding stays small) for a padded loader.

    Buckets are formed inside each shard and shuffled there; shard order is shuffled per epoch, so
    streaming with `iter_samples` over the flattened batches still reads each shard once.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    shard_ids = list(range(len(store.shards)))
    rng.shuffle(shard_ids)
    batches: list[list[int]] = []
    for k in shard_ids:
        members = sorted(store.shard_members(k), key=lambda i: -store.lengths[i])
        shard_batches = padded_batches(members, store.lengths, batch_tokens)
        rng.shuffle(shard_batches)
        batches.extend(shard_batches)
    return batches
