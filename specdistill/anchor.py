"""vLLM's `speculators` trainer beside ours: its own EAGLE-3 head, trained with its own code and defaults on a run's
prepared data and captured features (`benchmarks/anchor.py` then serves both heads in vLLM).

speculators reads, written here from our feature store:

    <inputs>/                         an HF dataset (save_to_disk, torch format): input_ids, loss_mask, seq_len
    <inputs>/hidden_states/hs_{i}.safetensors   row i's hidden_states [T, n_aux + 1, H] (our captured layers, then
                                      the final decoder layer's output before the final norm) and token_ids [T]
    <inputs>/d2t.npy, t2d.npy         our draft vocabulary, in the offset layout both sides use

Our training rows come first and our held-out rows last, and `--train-data-ratio` puts the cut between them, so
speculators trains on the rows we train on and validates on the rows we hold out (on a copy of the last training
row where we hold none out: it needs one). Layer ids: ours
(`target.capture_layers`) name a layer by its output, 0-based; vLLM and speculators name a hidden state by the layer
it enters (the output of layer k - 1), so our k is their k + 1, as our exports write it (`export/common.py`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specdistill.capture.store import FeatureStore
from specdistill.data.vocab import DraftVocab
from specdistill.engines import log_tail
from specdistill.io import atomic_dir, read_jsonl, write_json

log = logging.getLogger(__name__)
INTEROP_DIR = Path(__file__).resolve().parents[1] / ".interop"  # made by `make anchor`
WORKER = Path(__file__).with_name("anchor_worker.py")
# What a CPU needs of speculators 0.9.0: flex attention has no CPU backward and its fused loss is a Triton kernel.
# Everything else is its own default (muon, kl_div, 3 TTT steps, norm_before_fc and norm_output, packed rows).
CPU_ARGUMENTS = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0"]


class AnchorError(RuntimeError):
    """speculators could not train or is not installed; the message says which and how to fix it."""


def interop_dir() -> Path:
    if not (INTEROP_DIR / "speculators").is_dir():
        raise AnchorError(f"speculators is not installed in {INTEROP_DIR}; `make anchor` installs it there")
    return INTEROP_DIR


def write_inputs(store: FeatureStore, train_ids: list[int], holdout_ids: list[int], vocab: DraftVocab,
                 out: Path) -> dict:
    """speculators' dataset, hidden states and vocabulary for our `train_ids` then `holdout_ids`, written whole or
    not at all (and once for the same features); what was written."""
    if "last" not in store.teacher_keys:
        raise AnchorError(f"{store.path}: captured with teacher={store.manifest['teacher']!r}; speculators needs the "
                          "final layer's states (capture.teacher=last)")
    summary_file = out / "written.json"
    if summary_file.exists() and (written := json.loads(summary_file.read_text()))["features"] == str(store.path):
        log.info("speculators' inputs were written before from the same features: %s", out)
        return written
    order = [*train_ids, *(holdout_ids or train_ids[-1:])]  # speculators validates on one row at least
    row_of = {i: row for row, i in enumerate(order)}
    n_aux = len(store.manifest["layer_ids"])
    columns = {"input_ids": [None] * len(order), "loss_mask": [None] * len(order)}
    with atomic_dir(out) as tmp:
        (tmp / "hidden_states").mkdir()
        for i, sample in tqdm(store.iter_samples(order), total=len(order), desc="speculators inputs", unit="sample"):
            row, ids = row_of[i], sample["input_ids"].long()
            aux = sample["aux"].reshape(len(ids), n_aux, -1)
            save_file({"hidden_states": torch.cat([aux, sample["last"][:, None]], 1).contiguous(), "token_ids": ids},
                      str(tmp / "hidden_states" / f"hs_{row}.safetensors"))
            columns["input_ids"][row], columns["loss_mask"][row] = ids.tolist(), sample["loss_mask"].long().tolist()
        dataset = Dataset.from_dict({**columns, "seq_len": [len(ids) for ids in columns["input_ids"]]})
        dataset.set_format("torch")
        dataset.save_to_disk(str(tmp))
        np.save(tmp / "d2t.npy", vocab.d2t_N.numpy())
        np.save(tmp / "t2d.npy", vocab.t2d_V.numpy())
        lengths = [len(ids) for ids in columns["input_ids"]]
        written = {"features": str(store.path), "rows": len(order), "train_rows": len(train_ids),
                   "draft_vocab_size": vocab.size, "tokens": sum(lengths), "train_tokens": sum(lengths[: len(train_ids)]),
                   "longest": max(lengths)}
        write_json(tmp / "written.json", written)
    log.info("speculators' inputs (%d rows, %d tokens) written to %s", written["rows"], written["tokens"], out)
    return written


def speculators_layer_ids(layer_ids) -> list[int]:
    """Our captured layers (by output) in speculators' and vLLM's numbering (by the layer the state enters)."""
    return [int(k) + 1 for k in layer_ids]


def check_layer_ids(model, inputs: Path, their_ids: list[int], tokens: int = 256) -> None:
    """That slot j of the hidden states written for row 0 is the target's hidden state entering layer
    `their_ids[j]` (transformers' `hidden_states[k]`, the layer numbering vLLM and speculators share): of all the
    target's hidden states on that row, the nearest to each slot must be the one its id names."""
    with safe_open(str(inputs / "hidden_states" / "hs_0.safetensors"), framework="pt") as f:
        written, ids = f.get_tensor("hidden_states")[:tokens].float(), f.get_tensor("token_ids")[:tokens]
    with torch.no_grad():
        states = model(ids[None].to(model.device), output_hidden_states=True).hidden_states
    for j, claimed in enumerate(their_ids):
        gaps = [float((h[0].float().cpu() - written[:, j]).norm() / written[:, j].norm()) for h in states]
        nearest = min(range(len(gaps)), key=gaps.__getitem__)
        if nearest != claimed:
            raise AnchorError(f"{inputs}: hidden-state slot {j} of hs_0 is nearest the state entering layer {nearest} "
                              f"(relative gap {gaps[nearest]:.3g}), but speculators is told layer {claimed} (gap "
                              f"{gaps[claimed]:.3g}); the layer ids are off")


def speculators_arguments(inputs: Path, written: dict, verifier: Path, save_dir: Path, their_layer_ids: list[int],
                          steps: int, tokens_per_step: int) -> list[str]:
    """speculators' EAGLE-3 with its defaults, for `steps` optimizer steps of packed rows of `tokens_per_step`, and
    epochs enough to reach them: an epoch packs at least train tokens / `tokens_per_step` rows. It stops at
    `--max-steps`, but an epoch begun after that still makes one step, which its step records show."""
    epochs = max(1, math.ceil(steps / max(1, math.ceil(written["train_tokens"] / tokens_per_step))))
    return ["--verifier-name-or-path", str(verifier), "--data-path", str(inputs), "--save-path", str(save_dir),
            "--on-missing", "raise", "--d2t-path", str(inputs / "d2t.npy"), "--t2d-path", str(inputs / "t2d.npy"),
            "--draft-vocab-size", str(written["draft_vocab_size"]),
            "--target-layer-ids", *map(str, their_layer_ids),
            "--train-data-ratio", str((written["train_rows"] + 0.5) / written["rows"]),  # its cut rounds down
            "--total-seq-len", str(tokens_per_step), "--epochs", str(epochs), "--max-steps", str(steps),
            "--no-resume-from-checkpoint", *CPU_ARGUMENTS]


def train_speculators(arguments: list[str], save_dir: Path) -> dict:
    """Run speculators' trainer (`anchor_worker.py`) to the end; its last checkpoint and each step's record. A run
    that finished before with the same arguments (its `result.json`) is taken as it is; any other starts anew."""
    result_file = save_dir / "result.json"
    if result_file.exists() and (result := json.loads(result_file.read_text()))["arguments"] == arguments:
        log.info("speculators trained before with the same arguments; its head is reused from %s", save_dir)
        return result
    if save_dir.exists():
        shutil.rmtree(save_dir)
    save_dir.mkdir(parents=True)
    steps_file, log_file = save_dir / "steps.jsonl", save_dir / "train.log"
    steps_file.unlink(missing_ok=True)
    env = {key: value for key, value in os.environ.items() if key not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env |= {"PYTHONPATH": str(interop_dir()), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log.info("speculators: training its EAGLE-3 (log in %s)", log_file)
    with open(log_file, "w") as out:
        proc = subprocess.run([sys.executable, str(WORKER), str(steps_file), *arguments], env=env, stdout=out,
                              stderr=subprocess.STDOUT)
    epochs = sorted((p for p in save_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if proc.returncode != 0 or not epochs:
        raise AnchorError(f"speculators' trainer exited with code {proc.returncode}; its log is {log_file}, "
                          f"ending:\n{log_tail(log_file)}")
    result = {"checkpoint": str(epochs[-1]), "steps": read_jsonl(steps_file), "arguments": arguments}
    write_json(result_file, result)
    return result


def step_seconds(records: list[dict]) -> list[float]:
    """Each logged step's own time in seconds (speculators' `profile.step_ms`, its data fetch included)."""
    return [r["profile"]["step_ms"] / 1000 for r in records if r.get("profile")]


def step_tokens(records: list[dict]) -> list[int]:
    """Each logged step's tokens (speculators logs them as a rate over the step's time)."""
    return [round(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1000) for r in records if r.get("profile")]
