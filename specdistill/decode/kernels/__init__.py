"""Tree kernels, chosen at run time: CUDA tensors go to Triton, anything else to the torch reference.

`set_backend("torch" | "triton")` forces one (Triton on CPU needs TRITON_INTERPRET=1 set before the
Triton module is first imported; it is imported lazily, on first use). Every function here has the
same signature and result in `reference.py` and `triton_kernels.py`; see `reference.py` for what each
computes.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from torch import Tensor

from specdistill.decode.kernels import reference

BACKENDS = ("auto", "torch", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    """auto: Triton for CUDA tensors, torch otherwise; torch / triton: always that one."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend {name!r} is unknown; expected one of {list(BACKENDS)}")
    _backend = name


def get_backend() -> str:
    return _backend


def _implementation(tensor: Tensor) -> ModuleType:
    if _backend == "torch" or (_backend == "auto" and not tensor.is_cuda):
        return reference
    return importlib.import_module("specdistill.decode.kernels.triton_kernels")


def build_tree_tensors(parents_BN: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _implementation(parents_BN).build_tree_tensors(parents_BN)


def greedy_verify(
    tokens_BN: Tensor, next_token_BN: Tensor, next_sibling_BN: Tensor, target_argmax_BN: Tensor, num_slots: int
) -> tuple[Tensor, Tensor, Tensor]:
    return _implementation(tokens_BN).greedy_verify(
        tokens_BN, next_token_BN, next_sibling_BN, target_argmax_BN, num_slots
    )


def rejection_sample(
    tokens_BN: Tensor,
    next_token_BN: Tensor,
    next_sibling_BN: Tensor,
    target_probs_BNV: Tensor,
    draft_probs_BNV: Tensor | None,
    coins_BN: Tensor,
    final_u_B: Tensor,
    num_slots: int,
) -> tuple[Tensor, Tensor, Tensor]:
    return _implementation(tokens_BN).rejection_sample(
        tokens_BN, next_token_BN, next_sibling_BN, target_probs_BNV, draft_probs_BNV, coins_BN, final_u_B, num_slots
    )


def compact_kv(keys_BHLD: Tensor, values_BHLD: Tensor, tree_start: int, accept_nodes_BS: Tensor) -> None:
    _implementation(keys_BHLD).compact_kv(keys_BHLD, values_BHLD, tree_start, accept_nodes_BS)
