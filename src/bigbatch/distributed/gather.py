"""OpenCLIP-style gather-with-grad: every rank materialises the whole global batch.

Used for ``backend="reference"`` with a group (the full-matrix truth across ranks)
and as a benchmark peer. Memory per rank: the gathered features (B x D) and a
b_local x B logits matrix per direction -- exactly what the ring avoids.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .ring import Ring
from .._amp import autocast_off


def all_gather_rows(x: Tensor, ring: Ring, sizes: Sequence[int]) -> List[Tensor]:
    """Every rank's ``x`` (``sizes[r]`` rows on rank r, the same other dimensions), in rank order,
    without gradient: padded to the largest for one ``all_gather``, then cut back."""
    padded = x.detach().new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x.detach()
    parts: List[Tensor] = [torch.empty_like(padded) for _ in range(ring.world)]
    dist.all_gather(parts, padded, group=ring.group)
    return [p[:n] for p, n in zip(parts, sizes)]


class _GatherWithGrad(torch.autograd.Function):
    """Every rank's shard of each input concatenated into its global batch (sizes may differ), with
    gradient; each input also comes back as itself (a view), so that its local uses reach this node.

    Backward: the gradient of the sum of every rank's loss w.r.t. this rank's shard is its local
    gradient plus the sum over ranks of the gradient w.r.t. its rows in each rank's gathered copy:
    ONE all_reduce of all the gathered gradients, whichever inputs require grad on this rank. So
    every rank that runs a backward runs the same collective -- ranks may differ in which features
    require grad, or ask ``autograd.grad`` for different ones -- and the ``anchor`` (an empty leaf
    that requires grad, passed when the ranks agreed that a backward will run) keeps the node in the
    graph of a rank where only the scale requires grad.
    """

    @staticmethod
    def forward(ctx, ring: Ring, sizes: Sequence[Sequence[int]], anchor: Optional[Tensor], *xs: Tensor):  # type: ignore[override]
        ctx.ring, ctx.sizes = ring, [list(s) for s in sizes]
        gathered = [x.clone() if ring.world == 1 else torch.cat(all_gather_rows(x, ring, n)) for x, n in zip(xs, sizes)]
        return (*[x.view_as(x) for x in xs], *gathered)

    @staticmethod
    @autocast_off
    def backward(ctx, *grads: Tensor):
        ring, sizes = ctx.ring, ctx.sizes
        n = len(sizes)
        local, gathered = grads[:n], [g.contiguous() for g in grads[n:]]
        if ring.world > 1:  # one flat buffer: one collective (dtypes of the inputs may differ)
            dtype = functools.reduce(torch.promote_types, [g.dtype for g in gathered])
            flat = torch.cat([g.reshape(-1).to(dtype) for g in gathered])
            dist.all_reduce(flat, group=ring.group)
            gathered = [part.view_as(g).to(g.dtype) for part, g in zip(flat.split([g.numel() for g in gathered]), gathered)]
        out = []
        for g_local, g, rows in zip(local, gathered, sizes):
            start = sum(rows[: ring.rank])
            out.append(g_local + g[start : start + rows[ring.rank]])
        return (None, None, None, *out)


def gather_rows_with_grad(xs: Sequence[Tensor], ring: Ring, sizes: Sequence[Sequence[int]],
                          backward: bool) -> Tuple[List[Tensor], List[Tensor]]:
    """(each of ``xs`` as itself, each gathered into its global batch), with gradients flowing
    back to every rank's shards through one collective per backward. ``sizes[i]``: every rank's
    rows of ``xs[i]``. ``backward``: the ranks agreed that a backward will run (then every rank's
    node is kept in its graph). Use the returned local tensors, not ``xs``, in the loss."""
    anchor = torch.empty(0, device=xs[0].device, requires_grad=True) if backward and torch.is_grad_enabled() else None
    out = _GatherWithGrad.apply(ring, sizes, anchor, *xs)
    return list(out[: len(xs)]), list(out[len(xs):])


def gather_with_grad(x: Tensor, ring: Ring, sizes: Sequence[int]) -> Tensor:
    """The global batch (rank order) with gradients flowing back to every rank's shard (the
    OpenCLIP-style gather-with-grad; :func:`gather_rows_with_grad` gathers several at once)."""
    return _GatherWithGrad.apply(ring, [sizes], None, x)[1]
