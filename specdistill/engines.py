"""A serving engine (vLLM) in its own environment: its interpreter, the settings it runs with, and its worker
processes. The engine pins its own transformers, so our code never imports it: a worker script, run by the
engine's interpreter, imports nothing of ours and speaks JSON with us. The evaluation (`evaluate/engine.py`) runs
one worker per request; regeneration (`data/vllm_generate.py`) keeps one worker alive for the whole stage.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)
LOCAL_ENGINE_PYTHON = Path(__file__).resolve().parents[1] / ".engine" / "bin" / "python"  # made by `make engine`
# What the vLLM CPU backend needs on a shared machine; a value the user set wins.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
EXCEPTION_LINE = re.compile(r"\b\w*(Error|Exception): ")
LOG_TAIL_LINES = 30
POLL_S = 1.0  # how often a wait for a worker's reply checks that the worker is still alive
CLOSE_TIMEOUT_S = 60.0  # a worker told to stop (its input closed) gets this long to shut its engine down


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
    env = {**ENGINE_ENV, "OMP_NUM_THREADS": str(torch.get_num_threads()),
           # on a CPU the engine core runs inside the worker: its own process and the model runner's each import
           # torch and vLLM again and then share the cores, which doubles a short run's time (benchmarks/engine_start.py)
           **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if device is None or device.type == "cpu" else {}),
           **os.environ}
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


class EngineProcess:
    """One worker process in the engine's environment, kept alive across requests: each request is one JSON line
    on its stdin, each reply one JSON line on its stdout (the worker sends everything else it prints to stderr,
    which goes to `log_path`). The worker runs in a session of its own, so that closing it, or finding it dead,
    also ends the engine processes it started."""

    def __init__(self, name: str, python: str, worker: Path, log_path: Path, env: dict[str, str]):
        self.name, self.log_path = name, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log_file:
            self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log_file, env=env, start_new_session=True)
        self.working = False  # a request was sent and its reply not read (True after an interrupted wait)

    def ask(self, request: dict) -> dict:
        """The worker's reply to `request`; an EngineError, with the log's tail, if the worker dies first."""
        self.working = True
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        reply = json.loads(self._read_line())
        self.working = False
        return reply

    def _read_line(self) -> bytes:
        """One line from the worker, read as it arrives: an engine process the worker forked may hold the pipe open
        after the worker died, so the wait checks the worker itself instead of waiting for the pipe to close."""
        fd, line = self.proc.stdout.fileno(), bytearray()
        while not line.endswith(b"\n"):
            if select.select([fd], [], [], POLL_S)[0]:
                data = os.read(fd, 1 << 20)
                if not data:
                    raise self._died()
                line += data
            elif self.proc.poll() is not None:
                raise self._died()
        return bytes(line)

    def _died(self) -> EngineError:
        try:  # a worker that failed is still writing its traceback and shutting its engine down
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        self._end_session()
        code = self.proc.wait()
        return EngineError(f"{self.name} worker exited with code {code}; its log is {self.log_path}, ending:\n"
                           f"{log_tail(self.log_path)}")

    def close(self) -> None:
        """Stop the worker. An idle one is told to (its input ends) and shuts its engine down; one still working on
        a request nobody waits for any more, or one that does not stop in time, is killed with the processes it
        started."""
        if self.proc.poll() is None and not self.working:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s worker did not stop within %.0fs; killing it", self.name, CLOSE_TIMEOUT_S)
        self._end_session()
        self.proc.wait()

    def _end_session(self) -> None:
        """Kill whatever is left of the worker's session (the engine core a killed worker leaves behind)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
