"""Pure-PyTorch tiles for the sigmoid (SigLIP) loss: any device, the reference for the kernel.

For each ``tile_rows x tile_cols`` tile of ``u = scale * q @ k.T + bias`` one pass forms the
summed loss ``softplus(-z u)`` and the logits gradient ``G = sigmoid(u) - [z = +1]``, then
``dq_acc += G @ k`` and ``dk_acc += G.T @ q`` from the same tile (6*M*N*D FLOPs in all; 2*M*N*D
when no accumulator is given). Workspace: a few tiles in the compute dtype; never M x N.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import compute_dtype
from .torch_tiles import auto_tile, blocks, check_tile_sizes

# Workspace budget (bytes) of one step: ~4 tiles of logits-sized temporaries (u, z*u, G and
# the log-sigmoid) in the compute dtype, plus the upcast q and k blocks.
_AUTO_WORKSPACE_BYTES = {"cuda": 1 << 30, "cpu": 16 << 20}


def positive_mask(
    rows: slice,
    cols: slice,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    diagonal: Optional[int],
    device: torch.device,
) -> Optional[Tensor]:
    """Boolean (rows x cols) mask of the positive pairs of one tile, or None when it has none.

    Positives are ``q_ids[i] == k_ids[j]`` with ids, else ``j == i + diagonal`` (block indices).
    """
    if q_ids is not None:
        return q_ids[rows, None] == k_ids[None, cols]
    if diagonal is None:
        return None
    # j - i == diagonal intersects this tile only if the ranges overlap: skip the mask otherwise.
    lo = cols.start - (rows.stop - 1)
    hi = (cols.stop - 1) - rows.start
    if not lo <= diagonal <= hi:
        return None
    i = torch.arange(rows.start, rows.stop, device=device)
    j = torch.arange(cols.start, cols.stop, device=device)
    return (j[None, :] - i[:, None]) == diagonal


def check_ids(q_ids: Optional[Tensor], k_ids: Optional[Tensor], m: int, n: int) -> None:
    if (q_ids is None) != (k_ids is None):
        raise ValueError("q_ids and k_ids must be given together (positives are equal ids) or both be None")
    if q_ids is not None and (q_ids.shape != (m,) or k_ids.shape != (n,)):
        raise ValueError(f"q_ids/k_ids must have shapes ({m},)/({n},), got {tuple(q_ids.shape)}/{tuple(k_ids.shape)}")


@dataclass(frozen=True)
class TorchSigmoid:
    """Tiled sigmoid loss and gradients with ordinary torch ops (``None`` tiles: automatic).

    ``workspace_bytes``: budget of one automatic tile step (``None``: ``_AUTO_WORKSPACE_BYTES`` for
    the device); the ring lowers it by the bytes of its own buffers. Fixed tile sides win over it.
    """

    tile_rows: Optional[int] = None
    tile_cols: Optional[int] = None
    name: str = field(default="torch", init=False)  # the backend's kind, not a setting
    workspace_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        check_tile_sizes(self)
        w = self.workspace_bytes
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"TorchSigmoid: workspace_bytes must be a positive int or None, got {w!r}")

    def supports(self, device: torch.device) -> bool:
        return True

    def workspace_budget(self, device: torch.device) -> int:
        """Bytes one automatic tile step may take on ``device`` (``workspace_bytes`` or the default)."""
        return self.workspace_bytes or _AUTO_WORKSPACE_BYTES.get(device.type, 64 << 20)

    def workspace_for(self, m: int, n: int, d: int, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes of one tile step of ``sigmoid_pass`` on an M x N problem (the estimate its automatic
        tiles are sized by: 4 tile temporaries + the upcast q and k blocks, compute dtype)."""
        rows, cols = auto_tile(m, n, d, dtype, device, tiles=4, budget_bytes={device.type: self.workspace_budget(device)})
        rows, cols = self.tile_rows or rows, self.tile_cols or cols
        return (4 * rows * cols + (rows + cols) * d) * compute_dtype(dtype).itemsize

    def with_workspace(self, nbytes: int) -> "TorchSigmoid":
        """This backend with a tile-step budget of ``nbytes`` (the ring's share of the memory rule)."""
        return replace(self, workspace_bytes=max(1, int(nbytes)))

    def sigmoid_pass(
        self,
        q: Tensor,
        k: Tensor,
        scale: Tensor,
        bias: Tensor,
        *,
        q_ids: Optional[Tensor] = None,
        k_ids: Optional[Tensor] = None,
        diagonal: Optional[int] = 0,
        dq_acc: Optional[Tensor] = None,
        dk_acc: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        ct = compute_dtype(q.dtype)
        m, n = q.shape[0], k.shape[0]
        check_ids(q_ids, k_ids, m, n)
        budget = {q.device.type: self.workspace_budget(q.device)}
        rows, cols = auto_tile(m, n, q.shape[1], q.dtype, q.device, tiles=4, budget_bytes=budget)
        tr, tc = self.tile_rows or rows, self.tile_cols or cols
        loss = torch.zeros((), dtype=ct, device=q.device)
        g_sum = torch.zeros((), dtype=ct, device=q.device)
        for rs in blocks(m, tr):
            qi = q[rs].to(ct)
            for cs in blocks(n, tc):
                kj = k[cs].to(ct)
                u = torch.mm(qi, kj.t()).mul_(scale).add_(bias)
                pos = positive_mask(rs, cs, q_ids, k_ids, diagonal, q.device)
                if pos is None:
                    # All negatives: loss softplus(u) = -logsigmoid(-u), gradient sigmoid(u).
                    loss += F.logsigmoid(-u).sum().neg()
                    g = torch.sigmoid(u)
                else:
                    z = torch.where(pos, 1.0, -1.0).to(ct)
                    loss += F.logsigmoid(z * u).sum().neg()
                    # -sigmoid(-u) on positives (not sigmoid(u) - 1: no cancellation when u >> 0).
                    g = torch.sigmoid(-z * u).mul_(-z)
                g_sum += g.sum()
                if dq_acc is not None:
                    dq_acc[rs].addmm_(g, kj)
                if dk_acc is not None:
                    dk_acc[cs].addmm_(g.t(), qi)
        return loss, g_sum
