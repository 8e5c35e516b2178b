"""The autograd Function behind every tiled softmax loss.

``tiled_softmax_stats(q, k, scale, labels, backend, rows=, cols=)`` returns, for the
logits ``S = scale * q @ k.T``, the row and/or column log-sum-exp (from the backend,
one pass over the tiles) and the positive logits ``S_{i, labels_i}`` (O(B*D), chunked).
Every softmax loss is a weighted sum of these three vectors.

Saved for the backward: q, k (already alive as inputs), the labels and the O(B + N)
statistics; never a B x N tensor and no upcast copy of the features. The backward is
one ``backend.lse_grad`` call that recomputes each tile once and folds the positive
term into dS in fp32 before the products (see ``backends/base.py`` for why).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .backends.base import TileBackend, compute_dtype
from .backends.torch_tiles import blocks
from ._amp import autocast_off
from ._autograd import distinct, first_order

# Rows per chunk of the positive-logit dot products: bounds the fp32 temporaries to
# 2 * _POS_CHUNK * D elements whatever B is.
_POS_CHUNK = 16384


def positive_logits(q: Tensor, k: Tensor, labels: Tensor, scale: Tensor) -> Tensor:
    """``scale * <q_i, k_{labels_i}>`` in the compute dtype, chunked over rows (not differentiable)."""
    ct = compute_dtype(q.dtype)
    out = torch.empty(q.shape[0], dtype=ct, device=q.device)
    for rs in blocks(q.shape[0], _POS_CHUNK):
        out[rs] = (q[rs].to(ct) * k.index_select(0, labels[rs]).to(ct)).sum(dim=1)
    # out of place: torch 2.11's dynamo drops the gradient of a Function output that is the return
    # value of an in-place op (tests/test_compile.py)
    return out * scale.detach().to(ct)


class TiledSoftmaxStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, scale: Tensor, labels: Tensor, backend: TileBackend, rows: bool, cols: bool):
        lse_row, lse_col = backend.lse(q, k, scale, rows=rows, cols=cols)
        empty = q.new_empty((0,), dtype=compute_dtype(q.dtype))
        lse_row = lse_row if rows else empty
        lse_col = lse_col if cols else empty
        pos = positive_logits(q, k, labels, scale)
        ctx.backend, ctx.rows, ctx.cols = backend, rows, cols
        ctx.mark_non_differentiable(labels)
        # features made under inference_mode cannot be saved for a backward (a frozen tower's
        # output with a trained scale): a copy, O(B*D), in that case only
        tracing = torch.compiler.is_compiling()  # (no inference tensors inside a compiled graph)
        q_saved, k_saved = (t.clone() if not tracing and t.is_inference() else t for t in (q, k))
        ctx.save_for_backward(q_saved, k_saved, scale, labels, lse_row, lse_col)
        return lse_row, lse_col, pos

    @staticmethod
    @first_order
    @autocast_off
    def backward(ctx, g_row: Tensor, g_col: Tensor, g_pos: Tensor):
        q, k, scale, labels, lse_row, lse_col = ctx.saved_tensors
        dq, dk, d_scale = ctx.backend.lse_grad(
            q,
            k,
            scale,
            lse_row if ctx.rows else None,
            lse_col if ctx.cols else None,
            g_row if ctx.rows else None,
            g_col if ctx.cols else None,
            pos_labels=labels,
            g_pos=g_pos,
        )
        return dq, dk, d_scale.to(scale.dtype), None, None, None, None


def tiled_softmax_stats(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    labels: Tensor,
    backend: TileBackend,
    *,
    rows: bool = True,
    cols: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor], Tensor]:
    """Differentiable ``(lse_row (B,) or None, lse_col (N,) or None, pos (B,))`` of ``scale * q @ k.T``.

    ``scale``: 0-d tensor in the compute dtype on q's device; ``labels``: (B,) int64 in [0, N).
    """
    lse_row, lse_col, pos = TiledSoftmaxStats.apply(*distinct(q, k, scale, labels), backend, rows, cols)
    return (lse_row if rows else None), (lse_col if cols else None), pos
