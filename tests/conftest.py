"""Session-wide test setup.

Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before Triton
is first imported anywhere (DeepSpeed and torch import it too), so it is set here, at collection start.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdistill.engines import EngineNotInstalled, engine_python

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def engine_ready():
    """Skip where the engine (vLLM, `make engine`) is not installed; under SPECDISTILL_ENGINE=1 (make test SLOW=1)
    fail instead."""
    try:
        engine_python("vllm", None, "eval.engine.name=vllm")
    except EngineNotInstalled as err:
        if os.environ.get("SPECDISTILL_ENGINE") == "1":
            pytest.fail(f"SPECDISTILL_ENGINE=1 but no engine: {err}")
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """`python train.py +exp=smoke`, every stage, once for the tests that read a finished run (test_smoke.py,
    test_anchor.py): (run dir, the finished process, seconds)."""
    root = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "WANDB_API_KEY": "secret-key-never-written", "HF_HUB_OFFLINE": "1"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "train.py", "+exp=smoke", f"run_root={root}", "wandb.mode=offline",
                           "export.formats=[sglang,vllm,speculators]"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root / "smoke", proc, time.time() - t0
