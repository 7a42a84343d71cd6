"""Writing a feature store (`capture/store.py` has the layout and the reader): shards one at a time, each with a
progress record so a killed capture resumes, and the manifest last, atomically.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from specdistill.capture.store import FORMAT, HEADER_KEYS, MANIFEST, PROGRESS_DIR, shard_name
from specdistill.io import save_tensors, sha256_file, write_json

log = logging.getLogger(__name__)


class ShardWriter:
    """Writes shards one at a time and records each complete one, so a killed capture resumes.

    A shard is built in memory and written atomically; a shard file without a progress record of the
    same plan is partial (killed between write and record) and is discarded before it is redone.
    """

    def __init__(self, out_dir: str | Path, header: dict, rank: int = 0):
        self.out_dir = Path(out_dir)
        self.progress_dir = self.out_dir / PROGRESS_DIR
        self.plan_key = json.dumps({k: header[k] for k in HEADER_KEYS}, sort_keys=True)
        self.rank = rank
        self._shard_id: int | None = None
        self._sample_indices: list[int] = []
        self._samples: list[dict[str, torch.Tensor]] = []

    def _record_path(self, shard_id: int) -> Path:
        return self.progress_dir / shard_name(shard_id).replace(".safetensors", ".json")

    def completed(self, shard_ids: Iterable[int] | None = None, check_hash: bool = False) -> dict[int, dict]:
        """Records of complete shards of this plan (all, or those in `shard_ids`) whose file is present at
        the recorded size and, with `check_hash`, the recorded sha256 (a resume re-uses nothing unchecked)."""
        wanted = None if shard_ids is None else set(shard_ids)
        done = {}
        for path in sorted(self.progress_dir.glob("shard-*.json")):
            record = json.loads(path.read_text())
            if record.get("plan") != self.plan_key or (wanted is not None and record["shard"] not in wanted):
                continue
            shard = self.out_dir / record["file"]
            intact = shard.exists() and shard.stat().st_size == record["bytes"]
            if intact and check_hash and sha256_file(shard) != record["sha256"]:
                log.warning(
                    "shard %s differs from its progress record (corrupted); capturing it again", shard
                )
                intact = False
            if intact:
                done[record["shard"]] = {k: v for k, v in record.items() if k != "plan"}
        return done

    def clear_stale(self, num_shards: int) -> None:
        """Drop what another plan left behind: the manifest, foreign records, shards past the plan's end."""
        (self.out_dir / MANIFEST).unlink(missing_ok=True)
        for path in self.progress_dir.glob("shard-*.json"):
            if json.loads(path.read_text()).get("plan") != self.plan_key:
                path.unlink()
        for path in self.out_dir.glob("shard-*.safetensors"):
            if int(path.stem.split("-")[1]) >= num_shards:
                path.unlink()

    def discard_partial(self, shard_ids: Iterable[int]) -> None:
        """Remove unrecorded shard files and temp files of shards about to be (re)written."""
        for shard_id in shard_ids:
            name = shard_name(shard_id)
            self._record_path(shard_id).unlink(missing_ok=True)
            if (self.out_dir / name).exists():
                log.info("discarding partial shard %s (no progress record)", name)
                (self.out_dir / name).unlink()
            for tmp in self.out_dir.glob(f".{name}.*.tmp"):
                tmp.unlink()

    def begin(self, shard_id: int, sample_indices: list[int]) -> None:
        self._shard_id, self._sample_indices, self._samples = shard_id, list(sample_indices), []

    def add(self, sample: dict[str, torch.Tensor]) -> None:
        """One sample's per-token tensors (input_ids, loss_mask, aux, and last or topk_*), on CPU."""
        self._samples.append(sample)

    def finish(self) -> dict:
        """Write the shard atomically, then its progress record; returns the record."""
        if self._shard_id is None or len(self._samples) != len(self._sample_indices):
            raise RuntimeError(
                f"shard {self._shard_id}: {len(self._samples)} samples added, "
                f"{len(self._sample_indices)} planned"
            )
        lengths = [s["input_ids"].shape[0] for s in self._samples]
        offsets_S1 = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets_S1[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        tensors = {key: torch.cat([s[key] for s in self._samples]) for key in self._samples[0]}
        tensors["offsets"] = offsets_S1
        name = shard_name(self._shard_id)
        path = self.out_dir / name
        save_tensors(path, tensors)
        record = {
            "shard": self._shard_id,
            "file": name,
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "samples": len(lengths),
            "tokens": int(offsets_S1[-1]),
            "lengths": lengths,
            "sample_indices": self._sample_indices,
            "rank": self.rank,
        }
        write_json(self._record_path(self._shard_id), {"plan": self.plan_key, **record})
        self._shard_id, self._samples = None, []
        return record


def write_manifest(out_dir: str | Path, header: dict, records: list[dict]) -> Path:
    """The manifest, last and atomically: its presence means every shard it lists is complete."""
    path = Path(out_dir) / MANIFEST
    write_json(
        path,
        {
            "format": FORMAT,
            **header,
            "num_samples": sum(r["samples"] for r in records),
            "num_tokens": sum(r["tokens"] for r in records),
            "shards": records,
        },
    )
    return path
