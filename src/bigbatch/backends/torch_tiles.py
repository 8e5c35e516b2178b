"""Pure-PyTorch tile backend: runs on any device and is the reference for the kernels.

Memory: the workspace is a ``tile_rows x tile_cols`` block of logits and the temporaries built
from it (the backward holds about 5 tiles at once: the logits, their shifted exponentials, dS, a
column-direction copy; measured on the CPU, session 13) in the compute dtype, plus O(B + N)
statistics -- linear in the tile's area, never B x N. FLOPs: ``lse`` is one
pass over the tiles (2*B*N*D); ``lse_grad`` recomputes each tile once and forms both
``dS @ k`` and ``dS.T @ q`` from it (6*B*N*D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .base import compute_dtype

# Workspace of one tile step chosen automatically: 256 MiB on a GPU (big matmuls, few
# launches), 16 MiB on a CPU (near the caches, bounded RSS).
_AUTO_WORKSPACE_BYTES = {"cuda": 256 << 20, "cpu": 16 << 20}


def auto_tile(
    b: int,
    n: int,
    d: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    tiles: int = 3,
    budget_bytes: Optional[Dict[str, int]] = None,
) -> Tuple[int, int]:
    """A near-square (rows, cols) tile whose workspace fits the device's budget.

    Workspace of one step, in compute-dtype elements: ``tiles`` rows x cols temporaries (here:
    logits, their exponentials, the gradient tile) plus the upcast q and k blocks, (rows + cols) x d.
    ``budget_bytes`` maps device types to bytes (default: this backend's budgets).
    """
    per_device = budget_bytes or _AUTO_WORKSPACE_BYTES
    budget = per_device.get(device.type, 64 << 20) // compute_dtype(dtype).itemsize
    # Largest side with tiles*side^2 + 2*d*side <= budget.
    side = int((-2 * d + math.sqrt(4 * d * d + 4 * tiles * budget)) / (2 * tiles))
    side = max(16, side)
    rows = max(1, min(b, side))
    cols = max(1, min(n, (budget - rows * d) // (tiles * rows + d)))
    return rows, cols


def blocks(total: int, size: int) -> List[slice]:
    """Consecutive slices of ``size`` covering ``range(total)`` (the last may be shorter)."""
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def check_tile_sizes(backend: object) -> None:
    """``tile_rows`` / ``tile_cols`` of a tile backend: positive ints or None."""
    for arg in ("tile_rows", "tile_cols"):
        value = getattr(backend, arg)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{type(backend).__name__}: {arg} must be a positive int or None, got {value!r}")


def _add_positives(ds: Tensor, cols: Tensor, g: Tensor) -> None:
    """``ds[r, cols[r]] += g[r]`` for the rows whose column falls inside the tile (no host sync);
    columns outside the tile (other tiles, other blocks) are ignored."""
    hit = (cols >= 0) & (cols < ds.shape[1])
    rows = torch.arange(ds.shape[0], device=ds.device)
    ds.index_put_((rows, cols.clamp(0, ds.shape[1] - 1)), torch.where(hit, g, torch.zeros_like(g)), accumulate=True)


@dataclass(frozen=True)
class TorchTiles:
    """Tiled log-sum-exp statistics and gradients with ordinary torch ops.

    ``tile_rows`` / ``tile_cols`` fix the tile shape (they need not divide the
    batch); ``None`` picks it from B, N and the device.
    """

    tile_rows: Optional[int] = None
    tile_cols: Optional[int] = None
    name: str = field(default="torch", init=False)  # the backend's kind, not a setting

    def __post_init__(self) -> None:
        check_tile_sizes(self)

    def supports(self, device: torch.device) -> bool:
        return True

    def _tiles(self, q: Tensor, k: Tensor) -> Tuple[int, int]:
        rows, cols = auto_tile(q.shape[0], k.shape[0], q.shape[1], q.dtype, q.device)
        return self.tile_rows or rows, self.tile_cols or cols

    def lse(self, q: Tensor, k: Tensor, scale: Tensor, *, rows: bool, cols: bool):
        ct = compute_dtype(q.dtype)
        b, n = q.shape[0], k.shape[0]
        tr, tc = self._tiles(q, k)
        lse_row = q.new_full((b,), -math.inf, dtype=ct) if rows else None
        lse_col = q.new_full((n,), -math.inf, dtype=ct) if cols else None
        for rs in blocks(b, tr):
            qi = q[rs].to(ct)
            for cs in blocks(n, tc):
                s_tile = torch.mm(qi, k[cs].to(ct).t()).mul_(scale)
                # Both directions from the same tile; partials merge by logaddexp.
                if rows:
                    lse_row[rs] = torch.logaddexp(lse_row[rs], torch.logsumexp(s_tile, dim=1))
                if cols:
                    lse_col[cs] = torch.logaddexp(lse_col[cs], torch.logsumexp(s_tile, dim=0))
        return lse_row, lse_col

    def lse_grad(
        self, q, k, scale, lse_row, lse_col, g_row, g_col, *, pos_labels=None, g_pos=None, grad_dtype=None
    ):
        ct = compute_dtype(q.dtype)
        grad_dtype = grad_dtype or q.dtype
        use_rows = lse_row is not None and g_row is not None
        use_cols = lse_col is not None and g_col is not None
        pos = (pos_labels, g_pos.to(ct)) if pos_labels is not None and g_pos is not None else None
        dq = torch.zeros(q.shape, dtype=ct, device=q.device)
        dk = torch.zeros(k.shape, dtype=ct, device=k.device)
        if use_rows or use_cols or pos is not None:
            self._accumulate_grad(q, k, scale, lse_row, lse_col, g_row, g_col, pos, dq, dk, use_rows, use_cols)
        # d_scale = sum_i q_i . (dS @ k)_i, from the unscaled dq: O(B*D), no extra tile pass.
        d_scale = torch.dot(q.reshape(-1).to(ct), dq.reshape(-1))
        return dq.mul_(scale).to(grad_dtype), dk.mul_(scale).to(grad_dtype), d_scale

    def _accumulate_grad(self, q, k, scale, lse_row, lse_col, g_row, g_col, pos, dq, dk, use_rows, use_cols):
        """dq += dS @ k and dk += dS.T @ q (unscaled), recomputing each tile once."""
        ct = dq.dtype
        tr, tc = self._tiles(q, k)
        for rs in blocks(q.shape[0], tr):
            qi = q[rs].to(ct)
            for cs in blocks(k.shape[0], tc):
                kj = k[cs].to(ct)
                s_tile = torch.mm(qi, kj.t()).mul_(scale)
                ds = torch.zeros_like(s_tile) if not (use_rows or use_cols) else None
                if use_rows:
                    ds = torch.exp(s_tile - lse_row[rs, None]).mul_(g_row[rs, None].to(ct))
                if use_cols:
                    p_col = torch.exp(s_tile - lse_col[None, cs]).mul_(g_col[None, cs].to(ct))
                    ds = p_col if ds is None else ds.add_(p_col)
                if pos is not None:
                    _add_positives(ds, pos[0][rs] - cs.start, pos[1][rs])
                dq[rs].addmm_(ds, kj)
                dk[cs].addmm_(ds.t(), qi)
