"""OpenCLIP-style gather-with-grad: every rank materialises the whole global batch.

Used for ``backend="reference"`` with a group (the full-matrix truth across ranks)
and as a benchmark peer. Memory per rank: the gathered features (B x D) and a
b_local x B logits matrix per direction -- exactly what the ring avoids.
"""

from __future__ import annotations

from typing import List, Sequence

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
    """Concatenate every rank's shard (sizes may differ) into the global batch, with gradient.

    Backward: the gradient of the sum of every rank's loss w.r.t. this rank's shard is the
    sum over ranks of the gradient w.r.t. its copy in each rank's gathered tensor: one
    all_reduce of the (B x D) gradient, then this rank's rows.
    """

    @staticmethod
    def forward(ctx, x: Tensor, ring: Ring, sizes: Sequence[int]):
        ctx.ring, ctx.sizes = ring, list(sizes)
        if ring.world == 1:
            return x.clone()
        return torch.cat(all_gather_rows(x, ring, sizes))

    @staticmethod
    @autocast_off
    def backward(ctx, grad: Tensor):
        ring, sizes = ctx.ring, ctx.sizes
        grad = grad.contiguous()
        if ring.world > 1:
            grad = grad.clone()
            dist.all_reduce(grad, group=ring.group)
        start = sum(sizes[: ring.rank])
        return grad[start : start + sizes[ring.rank]], None, None


def gather_with_grad(x: Tensor, ring: Ring, sizes: Sequence[int]) -> Tensor:
    """The global batch (rank order) with gradients flowing back to every rank's shard."""
    return _GatherWithGrad.apply(x, ring, sizes)
