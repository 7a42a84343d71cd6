"""Least squares over large row sets: the fits that start (copy_init) and widen (widen) a head."""

from __future__ import annotations

import torch

RIDGE = 1e-6  # relative to the mean diagonal: keeps the least-squares solves well posed
CHUNK_ROWS = 8192  # rows per product in `gram`: bounded memory for a large vocabulary or long samples


def gram(rows_ND: torch.Tensor, other_NK: torch.Tensor | None = None) -> torch.Tensor:
    """rows^T @ other (other = rows by default) in float64 on the rows' device, a chunk of rows at a
    time, summed on the CPU: [D, K]."""
    width = rows_ND.shape[1] if other_NK is None else other_NK.shape[1]
    out = torch.zeros(rows_ND.shape[1], width, dtype=torch.float64)
    for i in range(0, len(rows_ND), CHUNK_ROWS):
        chunk = rows_ND[i:i + CHUNK_ROWS].double()
        other = chunk if other_NK is None else other_NK[i:i + CHUNK_ROWS].double()
        out += (chunk.T @ other).cpu()
    return out


def ridge_solve(gram_AA: torch.Tensor, cross_AB: torch.Tensor) -> torch.Tensor:
    """Least squares from its normal equations: (X^T X) W = X^T Y, W [A, B]."""
    eye = torch.eye(len(gram_AA), dtype=gram_AA.dtype)
    return torch.linalg.solve(gram_AA + RIDGE * gram_AA.diagonal().mean() * eye, cross_AB)
