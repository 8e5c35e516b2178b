"""The autograd Function behind every tiled softmax loss: log-sum-exp statistics of
``S = scale * q @ k.T`` from a backend, with gradients for ``q``, ``k`` and ``scale``.

Saved for the backward: q, k (already alive as inputs) and the O(B + N) statistics;
never a B x N tensor. The backward is one call to ``backend.lse_grad``, which
recomputes each tile once and returns dq, dk and d(scale) together.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .backends.base import TileBackend, compute_dtype


class TiledLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, scale: Tensor, backend: TileBackend, rows: bool, cols: bool):
        lse_row, lse_col = backend.lse(q, k, scale, rows=rows, cols=cols)
        empty = q.new_empty((0,), dtype=compute_dtype(q.dtype))
        lse_row = lse_row if rows else empty
        lse_col = lse_col if cols else empty
        ctx.backend, ctx.rows, ctx.cols = backend, rows, cols
        ctx.save_for_backward(q, k, scale, lse_row, lse_col)
        return lse_row, lse_col

    @staticmethod
    def backward(ctx, g_row: Tensor, g_col: Tensor):
        q, k, scale, lse_row, lse_col = ctx.saved_tensors
        dq, dk, d_scale = ctx.backend.lse_grad(
            q,
            k,
            scale,
            lse_row if ctx.rows else None,
            lse_col if ctx.cols else None,
            g_row if ctx.rows else None,
            g_col if ctx.cols else None,
        )
        return dq, dk, d_scale.to(scale.dtype), None, None, None


def tiled_lse(
    q: Tensor, k: Tensor, scale: Tensor, backend: TileBackend, *, rows: bool = True, cols: bool = False
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """Row and/or column log-sum-exp of ``scale * q @ k.T`` (differentiable, tiled).

    ``scale`` must be a 0-d tensor in the compute dtype on q's device.
    """
    lse_row, lse_col = TiledLSE.apply(q, k, scale, backend, rows, cols)
    return (lse_row if rows else None), (lse_col if cols else None)
