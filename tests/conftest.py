"""Session-wide test setup.

Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before Triton
is first imported anywhere (DeepSpeed and torch import it too), so it is set here, at collection start.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
