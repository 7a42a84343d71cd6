"""Training checkpoints: save, verify, resume, rotate, and the kept heads (best/, final/).

A checkpoint (`ckpt/step-N/`) holds accelerate's state (head, optimizer, scheduler), every rank's RNG
(`rng-rank-R.safetensors`) and consumed sample ids, and `trainer_state.json` (the data position, history and the
run's fingerprint: what the weights depend on). It is written to a temporary directory, checksummed last
(`checksums.json`) and renamed into place, so a killed run never leaves a half checkpoint under a step name; a
resume passes over a corrupted one to the one before it, and refuses one made for other inputs or settings.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from specdistill.fingerprint import TRAINED_ON, check_same
from specdistill.heads.checkpoint import save_head
from specdistill.io import (
    CorruptFile,
    atomic_dir,
    save_tensors,
    verify_checksums,
    write_checksums,
    write_json,
)
from specdistill.layout import RunLayout

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"


def save_rng(path: Path) -> None:
    """This rank's torch (CPU and CUDA), numpy and python RNG states, as safetensors (no pickle)."""
    py_version, py_state, _ = random.getstate()
    np_state = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(py_state, dtype=torch.int64),
               "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
               "numpy_pos": torch.tensor([np_state[2]], dtype=torch.int64)}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    save_tensors(path, tensors, metadata={"python_version": str(py_version)})


def load_rng(path: Path) -> None:
    t = load_file(str(path))
    torch.set_rng_state(t["torch"])
    random.setstate((3, tuple(int(x) for x in t["python"]), None))
    np.random.set_state(("MT19937", t["numpy"].numpy().astype(np.uint32), int(t["numpy_pos"][0]), 0, 0.0))
    if "cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["cuda"])


def trainer_state(ckpt: Path) -> dict:
    """A checkpoint's trainer_state.json; a missing or garbled one is a CorruptFile naming it."""
    path = ckpt / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CorruptFile(f"{path}: unreadable ({err})") from err


class CheckpointManager:
    """The run's checkpoints, for one rank of `world`; every rank calls every method (they meet inside)."""

    def __init__(self, layout: RunLayout, accelerator, rank: int, world: int, fingerprint: dict, run_name: str,
                 keep_last: int):
        self.layout, self.accelerator = layout, accelerator
        self.rank, self.world, self.fingerprint, self.run_name, self.keep_last = rank, world, fingerprint, run_name, keep_last

    def steps(self) -> list[Path]:
        return sorted(self.layout.ckpt_dir.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))

    def save(self, step: int, state: dict, history: list[dict], consumed: list[dict]) -> None:
        final = self.layout.step_dir(step)
        tmp = final.with_name(f".tmp-{final.name}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(tmp))
        save_rng(tmp / f"rng-rank-{self.rank}.safetensors")
        write_json(tmp / f"samples-rank-{self.rank}.json", {"micro_batches": consumed})
        self.accelerator.wait_for_everyone()
        if self.rank == 0:
            write_json(tmp / STATE_FILE, {**state, "history": history, "fingerprint": self.fingerprint})
            write_checksums(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in self.steps()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint %s (keeping the last %d)", final, self.keep_last)
        self.accelerator.wait_for_everyone()

    def discard(self) -> None:
        """restart=true: the run's checkpoints and training records go, whatever they were trained on."""
        ckpt, train = self.layout.ckpt_dir, self.layout.train_dir
        if self.rank == 0 and ckpt.exists():
            log.warning("restart=true: removing %s and %s", ckpt, train)
            shutil.rmtree(ckpt)
            shutil.rmtree(train, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def latest_intact(self) -> Path | None:
        """The newest step checkpoint whose files match their checksums (a corrupted newer one is passed over
        with a warning naming its bad file) and that was trained on this run's inputs and settings (else
        StaleRun says what changed); when every one is corrupted the error names them all."""
        corrupt = []
        for ckpt in reversed(self.steps()):
            try:
                verify_checksums(ckpt)
                recorded = trainer_state(ckpt)["fingerprint"]
            except (CorruptFile, KeyError) as err:
                log.warning("%s: %s; resuming from the checkpoint before it", ckpt, err)
                corrupt.append(f"{ckpt}: {err}")
                continue
            check_same(ckpt, recorded, self.fingerprint, self.run_name)
            return ckpt
        if corrupt:
            raise CorruptFile(f"every checkpoint in {self.layout.ckpt_dir} is corrupted: {'; '.join(corrupt)}; pass "
                              "restart=true to train from the start")
        return None

    def restore(self, ckpt: Path) -> tuple[dict, list[dict], list[dict]]:
        """Load `ckpt` into the accelerator and this rank's RNG; returns (trainer state, history, consumed ids)."""
        saved = trainer_state(ckpt)
        saved.pop("fingerprint")
        if saved.get("world") != self.world:
            raise RuntimeError(f"{ckpt} was written by {saved.get('world')} ranks, this run has {self.world}; "
                               "resume with the same number of processes (the data order depends on it)")
        try:
            self.accelerator.load_state(str(ckpt))
            load_rng(ckpt / f"rng-rank-{self.rank}.safetensors")
            consumed = json.loads((ckpt / f"samples-rank-{self.rank}.json").read_text())["micro_batches"]
        except Exception as err:  # accelerate's, safetensors' or json's own error, named with the checkpoint
            raise CorruptFile(f"{ckpt}: cannot be loaded ({type(err).__name__}: {err}); remove it to resume from the "
                              "one before, or pass restart=true") from err
        history = saved.pop("history")
        return saved, history, consumed

    def save_head(self, directory: Path, head, extra: dict | None = None) -> None:
        """Rank 0 keeps `head` in `directory` (best/ or final/) with the fingerprint it was trained on."""
        if self.rank != 0:
            return
        with atomic_dir(directory) as tmp:
            write_json(tmp / TRAINED_ON, self.fingerprint)
            save_head(head, tmp)
            if extra is not None:
                write_json(tmp / "best.json", extra)
