"""Rank and world size, read from torch.distributed: accelerate 1.15 reports `0 of 1` under DeepSpeed
on CPU even when DeepSpeed formed a real multi-rank group."""

from __future__ import annotations

import torch


def rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def launch_device() -> torch.device:
    """This process's device: its GPU (cuda:<local rank> under `accelerate launch`) when there is one, else
    the CPU. Forms the process group first when the launcher started several processes."""
    from accelerate import PartialState

    return PartialState().device


def join_launch() -> tuple[int, int, torch.device]:
    """(rank, world, device) of this process (stages before training have no Accelerator to form the group)."""
    device = launch_device()
    return (*rank_and_world(), device)


def leave_launch() -> None:
    """Tear the process group down once every rank is done: left to interpreter exit, gloo's threads can
    abort a rank ("terminate called without an active exception") after its work succeeded."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
