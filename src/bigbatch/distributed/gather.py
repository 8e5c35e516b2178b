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
from .._autograd import refuse_batched, refuse_create_graph


def all_gather_rows(x: Tensor, ring: Ring, sizes: Sequence[int]) -> List[Tensor]:
    """Every rank's ``x`` (``sizes[r]`` rows on rank r, the same other dimensions), in rank order,
    without gradient: padded to the largest for one ``all_gather``, then cut back."""
    padded = x.detach().new_zeros((max(sizes),) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x.detach()
    parts: List[Tensor] = [torch.empty_like(padded) for _ in range(ring.world)]
    dist.all_gather(parts, padded, group=ring.group)
    return [p[:n] for p, n in zip(parts, sizes)]


class _GatherWithGrad(torch.autograd.Function):
    """Each input comes back as itself (a view), and each input with ``sizes[i]`` (every rank's
    rows) also gathered into its global batch (rank order), with gradient.

    Backward: the gradient of the sum of every rank's loss w.r.t. this rank's shard is its local
    gradient plus the sum over ranks of the gradient w.r.t. its rows in each rank's gathered copy:
    ONE all_reduce of all the gathered gradients. Every use of the features *and the scale* goes
    through this node (pass the scale ungathered), so whatever a rank asks gradients for -- the
    features that require grad may differ between ranks, ``autograd.grad`` may name different
    inputs -- its backward runs this node, and every rank runs the same collective.
    """

    @staticmethod
    def forward(ctx, ring: Ring, sizes: Sequence[Optional[Sequence[int]]], dtype: Optional[torch.dtype],  # type: ignore[override]
                *xs: Tensor):
        for i, (x, n) in enumerate(zip(xs, sizes)):  # (a ring of one would not notice a wrong one)
            if n is not None and (len(n) != ring.world or int(n[ring.rank]) != x.shape[0]):
                raise ValueError(f"sizes[{i}] must list every rank's rows ({ring.world} entries, this rank's "
                                 f"{x.shape[0]}), got {list(n)}")
        ctx.ring, ctx.sizes = ring, [None if n is None else list(n) for n in sizes]
        ctx.dtypes = [x.dtype for x in xs]

        def cast(t: Tensor) -> Tensor:  # to the loss's compute dtype here, so gradients arrive in it
            return t if dtype is None or t.dtype == dtype else t.to(dtype)

        gathered = [cast(x.clone() if ring.world == 1 else torch.cat(all_gather_rows(x, ring, n)))
                    for x, n in zip(xs, sizes) if n is not None]
        return (*[x.view_as(x) if cast(x) is x else cast(x) for x in xs], *gathered)

    @staticmethod
    @autocast_off
    def backward(ctx, *grads: Tensor):
        ring, sizes = ctx.ring, ctx.sizes
        if ring.world > 1:  # all_reduce has no derivative: second-order terms would be missing
            refuse_create_graph("the distributed backend='reference' path (gather-with-grad)",
                                "compute second derivatives of a loss on one process with backend='reference'")
            refuse_batched("the distributed backend='reference' path (gather-with-grad)",
                           "its all_reduce takes one gradient", grads)
        local, gathered = list(grads[: len(sizes)]), [g.contiguous() for g in grads[len(sizes):]]
        # the sum over ranks in fp32 or wider (one flat buffer: one collective; dtypes may differ),
        # then one rounding to each input's dtype
        dtype = functools.reduce(torch.promote_types, [g.dtype for g in gathered], torch.float32)
        if ring.world > 1 and gathered:
            flat = torch.cat([g.reshape(-1).to(dtype) for g in gathered])
            dist.all_reduce(flat, group=ring.group)
            gathered = [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in gathered]), gathered)]
        it = iter(gathered)
        for i, rows in enumerate(sizes):
            if rows is not None:
                start = sum(rows[: ring.rank])
                local[i] = local[i].to(dtype) + next(it)[start : start + rows[ring.rank]].to(dtype)
        return (None, None, None, *[g if g is None else g.to(d) for g, d in zip(local, ctx.dtypes)])


def gather_rows_with_grad(xs: Sequence[Tensor], ring: Ring, sizes: Sequence[Optional[Sequence[int]]],
                          dtype: Optional[torch.dtype] = None) -> Tuple[List[Tensor], List[Optional[Tensor]]]:
    """(each of ``xs`` as itself, each with ``sizes[i]`` gathered into its global batch, else
    ``None``), all in ``dtype`` when given (the loss's compute dtype: half-precision features then
    get their gradients summed over ranks in fp32 and rounded once), with gradients flowing back to
    every rank's shards through one collective per backward. Use the returned local tensors, not
    ``xs``, everywhere in the loss."""
    out = _GatherWithGrad.apply(ring, sizes, dtype, *xs)
    it = iter(out[len(xs):])
    return list(out[: len(xs)]), [None if n is None else next(it) for n in sizes]


def gather_with_grad(x: Tensor, ring: Ring, sizes: Sequence[int]) -> Tensor:
    """The global batch (rank order) with gradients flowing back to every rank's shard (the
    OpenCLIP-style gather-with-grad; :func:`gather_rows_with_grad` gathers several at once)."""
    return _GatherWithGrad.apply(ring, [sizes], None, x)[1]
