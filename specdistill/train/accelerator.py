"""accelerate and DeepSpeed wiring, in one place: the accelerator for a train config, and what every rank must
agree on. Heads, losses and the TTT unroll are single-device code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdistill.config import ConfigError, TrainConfig
from specdistill.target import bf16_is_native

DEEPSPEED_DIR = Path(__file__).parent / "deepspeed"


def deepspeed_config(train: TrainConfig, precision: str) -> dict:
    """deepspeed/<name>.json (beside this file) completed from the train config (accumulation, clipping, precision)."""
    ds = json.loads((DEEPSPEED_DIR / f"{train.deepspeed}.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=train.grad_accum,
              gradient_clipping=train.grad_clip)
    ds["bf16"] = {"enabled": precision == "bf16"}
    return ds


def resolve_precision(precision: str, deepspeed: str | None) -> str:
    """`auto`: bf16 on a GPU, and on a CPU that multiplies bf16 natively (AMX or AVX512-BF16, ~4x its fp32
    rate) unless DeepSpeed runs there; fp32 otherwise."""
    if precision != "auto":
        return precision
    if torch.cuda.is_available():
        return "bf16"
    return "bf16" if deepspeed is None and bf16_is_native("cpu") else "no"


def make_accelerator(train: TrainConfig):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if train.deepspeed and "LOCAL_RANK" not in os.environ:
        raise ConfigError(f"train.deepspeed={train.deepspeed} needs a multi-process launch, e.g. `accelerate "
                          "launch --multi_gpu --num_processes 2 train.py ...` (--multi_gpu also on a CPU-only "
                          "machine: without it accelerate starts a single process)")
    precision = resolve_precision(train.mixed_precision, train.deepspeed)
    plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_config(train, precision)) if train.deepspeed else None
    # `cpu=True` would make accelerate drop DeepSpeed for plain DDP: on a CPU-only machine DeepSpeed finds
    # no GPU by itself and runs on the CPU over gloo
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=train.grad_accum,
                       deepspeed_plugin=plugin, cpu=not torch.cuda.is_available() and plugin is None)


def all_ranks_true(flag: bool) -> bool:
    """True only if `flag` holds on every rank (ranks must skip a step together or hang in the reduce)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors only
    t = torch.tensor([1 if flag else 0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())
