"""A serving engine (vLLM) in its own environment: its interpreter, the settings it runs with, and its worker
processes. The engine pins its own transformers, so our code never imports it: a worker script, run by the
engine's interpreter, imports nothing of ours and speaks JSON with us (`evaluate/engine.py`: one worker per
request).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import torch

LOCAL_ENGINE_PYTHON = Path(__file__).resolve().parents[1] / ".engine" / "bin" / "python"  # made by `make engine`
# What the vLLM CPU backend needs on a shared machine; a value the user set wins.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
EXCEPTION_LINE = re.compile(r"\b\w*(Error|Exception): ")
LOG_TAIL_LINES = 30


class EngineError(RuntimeError):
    """The engine could not do its work; the message names the engine, the run and its log file."""


class EngineNotInstalled(EngineError):
    """The configuration asks for an engine this machine does not have: a user error, with how to install it."""


def engine_python(engine: str, configured: str | None, asked_by: str) -> str:
    """The interpreter that has the engine: as configured, else `.engine/` beside the package, else this one.
    `asked_by` is the setting that wants the engine (`eval.engine.name=vllm`), named in the error."""
    if configured:
        if shutil.which(configured) is None:
            raise EngineNotInstalled(f"{asked_by}: eval.engine.python={configured} is not an interpreter here")
        return configured
    if LOCAL_ENGINE_PYTHON.exists():
        return str(LOCAL_ENGINE_PYTHON)
    if importlib.util.find_spec(engine) is None:
        raise EngineNotInstalled(f"{asked_by}: {engine} is not installed here; `make engine` installs it into "
                                 f"{LOCAL_ENGINE_PYTHON.parents[1]}, or set eval.engine.python to an interpreter that "
                                 "has it")
    return sys.executable


def engine_env(device: torch.device | None = None) -> dict[str, str]:
    """The environment a worker runs in: the engine's CPU settings, our thread count, and on a GPU only this
    process's GPU (under `accelerate launch` each rank's engine takes its own)."""
    env = {**ENGINE_ENV, "OMP_NUM_THREADS": str(torch.get_num_threads()), **os.environ}
    if device is not None and device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        index = device.index if device.index is not None else torch.cuda.current_device()
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    return env


def log_tail(log_path: Path) -> str:
    """The last lines of a worker's log, led by its first exception line when that scrolled out of them (a
    worker's own error is logged early, and the engine's shutdown messages follow it)."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    tail = lines[-LOG_TAIL_LINES:]
    first = next((line for line in lines if EXCEPTION_LINE.search(line)), None)
    return "\n".join(([first] if first is not None and first not in tail else []) + tail)
