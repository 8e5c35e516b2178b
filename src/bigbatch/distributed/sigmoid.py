"""The sigmoid (SigLIP) loss over a ring of ranks, with memory O(b_local * D) per rank.

Each rank holds a shard of the image/text pairs (shards may differ in size). The text blocks
travel around the ring (:meth:`Ring.shift`, overlapped with compute); at every step this rank
runs one backend pass of its images against the visiting block, which yields the loss, adds
``G @ k`` into its own ``dq`` and produces the block's ``dk`` contribution. That contribution
is added to the partial ``dk`` received from the previous rank and sent on with the block, so
after ``world`` steps each block's complete ``dk`` arrives back at its owner. Everything is
done in the forward pass (no global statistic is needed); the backward only scales the kept
gradients. Per rank: two text blocks, two fp32 ``dk``-sized buffers and ``dq``, whatever
the number of ranks (OpenCLIP's neighbour exchange keeps every step's logits for autograd).

Value and gradients (OpenCLIP's convention, correct also for uneven shards): rank r returns
``world / B * sum_{i in r, all j} l_ij``. The mean over ranks of the returned values is the
global loss ``(1/B) sum_ij l_ij``, and gradients averaged over ranks (DDP) are the
single-process gradients for the features, the scale and the bias.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.autograd.function import once_differentiable
from torch import Tensor

from .._validate import check_pair, prepare_scalar
from ..backends.base import SigmoidBackend, compute_dtype
from ..sigmoid_loss import check_class_ids, resolve_sigmoid_backend
from .ring import Ring, agree, dtype_code


def _ring_pass(
    ring: Ring,
    sizes: List[int],
    q: Tensor,
    k: Tensor,
    ids: Optional[Tensor],
    scale: Tensor,
    bias: Tensor,
    backend: SigmoidBackend,
    with_grad: bool,
    *,
    with_dq: bool = True,
    dk_weight: Optional[Tensor] = None,
):
    """Loss sum and (unscaled) ``dq``, own-block ``dk``, ``sum G`` over all blocks of the ring.

    ``dk_weight``: this rank's contributions to the travelling ``dk`` are multiplied by it (the
    backward's re-run when ranks' upstream gradients differ). ``with_dq=False`` skips ``dq``.
    """
    ct = compute_dtype(q.dtype)
    world, b, d = ring.world, q.shape[0], q.shape[1]
    bmax = max(sizes)
    # Two text blocks (the one computed on and sent, the one arriving) and two fp32 dk blocks
    # (the partial accumulated and sent on, the next one arriving): 2*bmax*D*(itemsize + 4) bytes.
    k_bufs = [k.new_empty((bmax, d)) for _ in range(2)] if world > 1 else []
    id_bufs = [ids.new_empty((bmax,)) for _ in range(2)] if (world > 1 and ids is not None) else []
    dq = torch.zeros((b, d), dtype=ct, device=q.device) if (with_grad and with_dq) else None
    dk_bufs = [torch.empty((bmax, d), dtype=ct, device=q.device) for _ in range(2)] if with_grad else []
    loss = torch.zeros((), dtype=ct, device=q.device)
    g_sum = torch.zeros((), dtype=ct, device=q.device)
    k_cur, ids_cur = k, ids
    dk_pending = None  # the dk shift posted after the previous step
    for t in range(world):
        src = ring.block_at(t)
        n = sizes[src]
        k_pending = None
        if t + 1 < world:
            n_next = sizes[ring.block_at(t + 1)]
            send, recv = [k_cur], [k_bufs[t % 2][:n_next]]
            if ids is not None:
                send.append(ids_cur)
                recv.append(id_bufs[t % 2][:n_next])
            k_pending = ring.shift(send, recv)
        dk_loc = None
        if with_grad:
            if dk_pending is None:
                dk_loc = dk_bufs[0][:n].zero_()
            else:
                # The partial dk of block ``src`` from ranks src .. rank-1 (sent by prev after its
                # step t-1); our contribution is added in place. Waiting here costs one dk transfer
                # per step, small next to the step's b*n*D compute.
                dk_loc = dk_pending.wait()[0]
        acc = dk_loc
        if dk_weight is not None:
            acc = torch.zeros_like(dk_loc)
        step_loss, step_g = backend.sigmoid_pass(
            q,
            k_cur,
            scale,
            bias,
            q_ids=ids,
            k_ids=ids_cur,
            diagonal=0 if src == ring.rank else None,
            dq_acc=dq,
            dk_acc=acc,
        )
        loss += step_loss
        g_sum += step_g
        if with_grad:
            if dk_weight is not None:
                dk_loc.add_(acc.mul_(dk_weight))
            # Send it on: prev's step-t block is ours at t+1; after step world-1 it reaches its owner.
            # The receive buffer is the one whose send (posted at step t-1) completed in the wait above.
            dk_pending = ring.shift([dk_loc], [dk_bufs[(t + 1) % 2][: sizes[ring.block_at(t + 1)]]])
        if k_pending is not None:
            recv = k_pending.wait()
            k_cur = recv[0]
            ids_cur = recv[1] if ids is not None else None
    dk = None
    if with_grad:
        dk = dk_pending.wait()[0]  # our own block's dk, complete (a view of one ring buffer)
    return loss, dq, dk, g_sum


class _RingSigmoid(torch.autograd.Function):
    """Forward: the whole ring pass, keeping dq, the own block's dk and the scalar gradients.

    Backward semantics (as the softmax ring): each rank gets the gradient of the sum over ranks
    of every rank's output times its upstream gradient. ``dq``, ``d_scale``, ``d_bias`` only
    involve this rank's rows, so they are the kept values times this rank's upstream gradient.
    ``dk`` mixes all ranks' rows: when every rank's upstream gradient is the same (the usual
    ``loss.backward()``; one tiny all_gather checks it) it is the kept value times that gradient;
    otherwise the ring is run again with each rank's contributions weighted by its gradient.
    """

    @staticmethod
    def forward(ctx, q, k, scale, bias, ids, ring, sizes, backend, norm: float):
        ct = compute_dtype(q.dtype)
        loss, dq, dk, g_sum = _ring_pass(ring, sizes, q, k, ids, scale, bias, backend, with_grad=True)
        d_scale = torch.dot(q.reshape(-1).to(ct), dq.reshape(-1)).mul_(norm)
        factor = scale * norm
        dq.mul_(factor)
        dk.mul_(factor)
        ctx.in_dtype = q.dtype
        ctx.ring, ctx.sizes, ctx.backend, ctx.ids, ctx.norm = ring, sizes, backend, ids, norm
        ctx.save_for_backward(q, k, scale, bias, dq, dk, d_scale, g_sum.mul_(norm))
        return loss.mul_(norm)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, scale, bias, dq, dk, d_scale, d_bias = ctx.saved_tensors
        g = grad.to(dq.dtype)
        ring = ctx.ring
        if ring.world > 1:
            import torch.distributed as dist

            mine = g.detach().reshape(1).to(torch.float64)
            every = [torch.empty_like(mine) for _ in range(ring.world)]
            dist.all_gather(every, mine, group=ring.group)
            if any(not torch.equal(x, mine) for x in every):  # same decision on every rank
                _, _, dk_w, _ = _ring_pass(
                    ring, ctx.sizes, q, k, ctx.ids, scale, bias, ctx.backend, with_grad=True, with_dq=False, dk_weight=g
                )
                return ((dq * g).to(ctx.in_dtype), dk_w.mul_(scale * ctx.norm).to(ctx.in_dtype), d_scale * g,
                        d_bias * g, None, None, None, None, None)
        return (dq * g).to(ctx.in_dtype), (dk * g).to(ctx.in_dtype), d_scale * g, d_bias * g, None, None, None, None, None


def ring_siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    scale,
    bias,
    *,
    labels: Optional[Tensor] = None,
    group,
    backend="auto",
) -> Tensor:
    """This rank's share of the global sigmoid loss (see the module docstring for the convention).

    Every rank of ``group`` must call it (a collective). Invalid input on any rank raises the same
    ``ValueError`` on every rank instead of leaving the others waiting.
    """
    ring = Ring.of(group)
    device = image_features.device if isinstance(image_features, Tensor) else torch.device("cpu")
    error = None
    s = b = ids = impl = None
    try:
        check_pair("image_features", image_features, "text_features", text_features, same_rows=True)
        s = prepare_scalar("scale", scale, image_features)
        b = prepare_scalar("bias", bias, image_features)
        ids = check_class_ids(labels, image_features.shape[0], device)
        impl = resolve_sigmoid_backend(backend, device, image_features.dtype)
        if impl == "reference":
            raise ValueError("backend='reference' has no ring form; use 'auto', 'torch' or 'triton' with group=")
    except (TypeError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    ok = error is None
    table = agree(
        ring,
        device,
        {
            "rows": image_features.shape[0] if ok else 0,
            "dim": image_features.shape[1] if ok else 0,
            "dtype": dtype_code(image_features.dtype) if ok else 0,
            "labels": float(labels is not None),
            "scale": float(s) if ok else 0.0,
            "bias": float(b) if ok else 0.0,
        },
        same=("dim", "dtype", "labels", "scale", "bias"),
        local_error=error,
        what="siglip_loss",
    )
    sizes = [int(v) for v in table["rows"]]
    norm = ring.world / sum(sizes)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (image_features, text_features, s, b))
    if needs_grad:
        return _RingSigmoid.apply(image_features, text_features, s, b, ids, ring, sizes, impl, norm)
    loss, _, _, _ = _ring_pass(ring, sizes, image_features, text_features, ids, s, b, impl, with_grad=False)
    return loss * norm
