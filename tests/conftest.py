"""Session-wide test setup.

Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before Triton
is first imported anywhere (DeepSpeed and torch import it too), so it is set here, at collection start.
"""

import os

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
