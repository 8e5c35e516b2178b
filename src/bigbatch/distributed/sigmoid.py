"""The sigmoid (SigLIP) loss over a ring of ranks, in the transient memory of one GPU.

Each rank holds a shard of the image/text pairs (shards may differ in size). This rank's images
``q`` (b x D) meet every text block; the sigmoid loss needs no global statistic, so one pass
gives the loss, ``dq`` (accumulated here) and every block's ``dk`` contribution (which must reach
the block's owner). Everything is done in the forward pass; the backward scales what was kept.

Schedule (:class:`RingPlan`): every block ``j`` is cut into the same number ``C`` of near-equal
row chunks (``chunk(n_j, c)``; every rank knows ``sizes``, so all agree without messages).
Position ``(c, s)`` for ``c < C``, ``s < world``: this rank computes its images against chunk
``c`` of block ``ring.block_at(s)`` (its own at ``s = 0``). Chunk ``c`` of a block visits the
ranks in ring order at consecutive positions, so at every position each rank:

* sends the text chunk it computes on to ``next`` and receives the one of its next position from
  ``prev`` (it does not depend on compute: overlapped with this position's compute);
* computes its ``dk`` contribution into a zeroed fp32 slot while the block's partial ``dk`` for
  this chunk (from ranks ``j .. rank-1``) arrives from ``prev``; then adds the two and sends the
  sum during the NEXT position (also overlapped). After the ``world``-th rank it is complete and
  lands in the owner's ``dk`` (at ``s = 0`` of the next round, or one final shift).

One :meth:`Ring.shift` per position pairs send-to-next with receive-from-prev; its messages are
[text chunk (+ ids chunk), previous dk result] and [next text chunk (+ ids), this dk partial] in
that order on every rank, and a rank sends a message exactly when its ``next`` expects it (same
chunk of the same block, same emptiness), so posting orders match for NCCL and gloo.

Memory per rank (the issue-7 rule, :func:`plan_ring`): one GPU at local batch ``b`` holds fp32
``dq`` + ``dk`` (b x D each) + the backend's workspace ``W`` for a b x b problem. A rank holds ``dq`` + its own
block's ``dk`` + slots of ``chunk_rows`` rows -- text chunks (1 slot with 2 ranks, 2 with more;
+ their int64 ids with ``labels``) and 3 fp32 dk chunks (computing, arriving, leaving) -- + the
backend's workspace, which the ring lowers to ``W' = W - slots - 1 MiB``. So the total is one GPU's
whatever the number of ranks, except where the floors bite (tiny b, huge D: see :class:`RingPlan`).
FLOPs per rank: ``6 * b * B * D`` (B global), as on one GPU.

Value and gradients (OpenCLIP's convention, correct also for uneven shards): rank r returns
``world / B * sum_{i in r, all j} l_ij`` as its gradient's loss, whose mean over ranks is the
global loss ``(1/B) sum_ij l_ij``; the returned value is that global loss on every rank
(:func:`~bigbatch.distributed.ring.global_value`). Gradients averaged over ranks (DDP) are the
single-process gradients for the features, the scale and the bias.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from .._autograd import refuse_transformed
from .._validate import check_pair, prepare_scalar, require_group
from ..backends.base import SigmoidBackend, compute_dtype
from ..sigmoid_loss import check_class_ids, resolve_sigmoid_backend
from .ring import Ring, agree, dtype_code, error_message, global_value
from .._amp import autocast_off
from .._autograd import first_order

# The memory rule. W = the workspace the backend uses on one GPU for a b x b problem
# (``backend.workspace_for``; TritonSigmoid: its G tile, 512 MiB on a GPU for b >= 16384;
# TorchSigmoid: its tile temporaries, up to 1 GiB). The chunk size is set by W of the largest
# shard (the same on every rank); each rank's backend share by its own W.
# The ring's slots take at most W / _RING_SHARE ...
_RING_SHARE = 2
# ... but a chunk has at least this many rows (or the whole block): narrower column chunks run the
# tile kernel and the two GEMMs far below their rate and stop hiding a chunk's p2p latency (~10 us).
_MIN_CHUNK_ROWS = 1024
# ... and the backend keeps at least W / _MIN_BACKEND_SHARE (its tiles shrink, never vanish).
_MIN_BACKEND_SHARE = 4
# W assumed for a backend object that does not report one (it is then not told a smaller one).
_DEFAULT_WORKSPACE = 256 << 20
# Also kept back from the backend: the ring's small tensors (metadata exchange, per-position loss
# scalars), so that "no larger than one GPU" holds to the byte, not only up to a few KiB.
_SMALL_BYTES = 1 << 20


@dataclass(frozen=True)
class RingPlan:
    """How one call splits the ring's work and memory (a pure function of agreed metadata).

    Bytes: ``slot_bytes`` for the ring's chunk buffers, ``backend_workspace`` (W') for the backend,
    out of the one-GPU budget ``workspace`` (W). ``slot_bytes + backend_workspace <= workspace``
    unless a floor bites: slots of ``min(b, _MIN_CHUNK_ROWS)`` rows above ``W/2`` (then the
    backend keeps ``max(W - slots - 1 MiB, W/4)``), or an explicit ``chunk_rows``; then the ring
    exceeds one GPU by ``slot_bytes + backend_workspace - workspace``. It happens (a) for tiny
    local batches, whose one-GPU G tile is only ``b^2 * itemsize``: with TritonSigmoid, D = 512,
    bf16 and 2 ranks, below b ~ 2,700 (by at most ~8 MiB); (b) for huge D: 1024 rows of slots
    above 3W/4 with W = 512 MiB means D > ~19,600 (fp32, 3+ ranks) or ~24,500 (bf16).
    """

    world: int
    chunks: int  # C: every block is cut into C row chunks (the same C on every rank)
    chunk_rows: int  # rows of the largest chunk, = ceil(max(sizes) / C): the size of every slot
    k_slots: int  # text-chunk slots: 0 (world 1), 1 (world 2), 2 (world >= 3)
    dk_slots: int  # fp32 dk-chunk slots: 3 with gradients on a ring of 2+, else 0
    row_bytes: int  # bytes of one row of all slots together
    slot_bytes: int  # chunk_rows * row_bytes
    workspace: int  # W: the backend's workspace on one GPU at this rank's local batch
    backend_workspace: int  # W': what the backend is told it may use

    def chunk(self, n: int, c: int) -> slice:
        """Rows of chunk ``c`` of a block of ``n`` rows (near-equal parts; some empty if n < C)."""
        return slice(c * n // self.chunks, (c + 1) * n // self.chunks)


def plan_ring(
    sizes: Sequence[int],
    d: int,
    dtype: torch.dtype,
    *,
    with_grad: bool,
    workspace: int,
    chunk_workspace: Optional[int] = None,
    id_itemsize: int = 0,
    chunk_rows: Optional[int] = None,
) -> RingPlan:
    """The chunking and the memory split of one ring call (see :class:`RingPlan`).

    ``sizes``: rows per rank; ``d``: feature dim; ``dtype``: the features' dtype; ``workspace``: W
    of this rank (one GPU at its local batch); ``chunk_workspace``: W of the largest shard, which
    sets the chunk size on every rank alike (default ``workspace``); ``id_itemsize``: bytes per
    class id travelling with the text (0 without labels); ``chunk_rows``: force the chunk size
    (tests, tuning) instead of the rule. With uneven shards, a rank much smaller than the largest
    has slots sized by the largest and may exceed its own one-GPU value by up to the slots.
    """
    world, bmax = len(sizes), max(int(n) for n in sizes)
    ct = compute_dtype(dtype).itemsize
    k_slots = min(2, world - 1)
    dk_slots = 3 if (with_grad and world > 1) else 0
    row_bytes = k_slots * (d * torch.empty((), dtype=dtype).element_size() + id_itemsize) + dk_slots * d * ct
    if world == 1:
        return RingPlan(1, 1, bmax, 0, 0, row_bytes, 0, workspace, workspace)
    if chunk_rows is None:
        common = workspace if chunk_workspace is None else chunk_workspace
        chunk_rows = max(_MIN_CHUNK_ROWS, common // _RING_SHARE // max(row_bytes, 1))
    rows = max(1, min(bmax, int(chunk_rows)))
    chunks = -(-bmax // rows)
    rows = -(-bmax // chunks)  # the largest chunk actually cut: ceil(bmax / C) <= the asked rows
    slot_bytes = rows * row_bytes
    backend = max(workspace - slot_bytes - _SMALL_BYTES, workspace // _MIN_BACKEND_SHARE)
    return RingPlan(world, chunks, rows, k_slots, dk_slots, row_bytes, slot_bytes, workspace, backend)


def transient_bytes(b: int, d: int, dtype: torch.dtype, plan: RingPlan) -> int:
    """Bytes a rank allocates beyond its inputs in a forward with gradients: fp32 ``dq`` and own
    ``dk`` (b x D each) + slots + the backend's workspace (one GPU: ``plan_ring`` with one size)."""
    return 2 * b * d * compute_dtype(dtype).itemsize + plan.slot_bytes + plan.backend_workspace


def _ring_pass(
    ring: Ring,
    sizes: List[int],
    q: Tensor,
    k: Tensor,
    ids: Optional[Tensor],
    scale: Tensor,
    bias: Tensor,
    backend: SigmoidBackend,
    plan: RingPlan,
    with_grad: bool,
    *,
    with_dq: bool = True,
    dk_weight: Optional[Tensor] = None,
    stats: Optional[Dict[str, int]] = None,
):
    """Loss sum and (unscaled) ``dq``, own-block ``dk``, ``sum G`` over all blocks of the ring.

    ``dk_weight``: this rank's contributions to the travelling ``dk`` are multiplied by it (the
    backward's re-run when ranks' upstream gradients differ). ``with_dq=False`` skips ``dq``.
    ``stats`` (tests): receives the bytes of the slots this call allocated.
    """
    ct = compute_dtype(q.dtype)
    world, rank = ring.world, ring.rank
    q, k = q.contiguous(), k.contiguous()
    b, d = q.shape
    dq = torch.zeros((b, d), dtype=ct, device=q.device) if (with_grad and with_dq) else None
    loss = torch.zeros((), dtype=ct, device=q.device)
    g_sum = torch.zeros((), dtype=ct, device=q.device)
    if world == 1:
        dk = torch.zeros((b, d), dtype=ct, device=q.device) if with_grad else None
        loss, g_sum = backend.sigmoid_pass(q, k, scale, bias, q_ids=ids, k_ids=ids, diagonal=0, dq_acc=dq, dk_acc=dk)
        if dk is not None and dk_weight is not None:
            dk.mul_(dk_weight)
        return loss, dq, dk, g_sum
    # Every row of the own dk is written once by an arriving complete chunk: no zero fill needed.
    dk = torch.empty((b, d), dtype=ct, device=q.device) if with_grad else None
    rows = plan.chunk_rows
    k_pool = [k.new_empty((rows, d)) for _ in range(plan.k_slots)]
    id_pool = [ids.new_empty((rows,)) for _ in range(plan.k_slots)] if ids is not None else []
    dk_free = [torch.empty((rows, d), dtype=ct, device=q.device) for _ in range(plan.dk_slots if with_grad else 0)]
    if stats is not None:
        stats["slot_bytes"] = sum(t.numel() * t.element_size() for t in k_pool + id_pool + dk_free)
    own = sizes[rank]
    out: Optional[Tensor] = None  # the previous position's dk result (a dk slot view), sent now
    out_slot: Optional[Tensor] = None
    kx: Optional[Tensor] = None
    ix: Optional[Tensor] = None
    for c in range(plan.chunks):
        for s in range(world):
            j = ring.block_at(s)
            x = plan.chunk(sizes[j], c)
            n = x.stop - x.start
            if s == 0:  # our own block: the inputs themselves
                kx, ix = k[x], (ids[x] if ids is not None else None)
            send: List[Tensor] = []
            recv: List[Tensor] = []
            nn = 0
            if s < world - 1:
                # Text chunk c of block j goes to next (its position (c, s + 1)); prev's arrives for ours.
                xn = plan.chunk(sizes[ring.block_at(s + 1)], c)
                nn = xn.stop - xn.start
                if n:
                    send += [kx] + ([ix] if ids is not None else [])
                if nn:
                    recv += [k_pool[s % 2][:nn]] + ([id_pool[s % 2][:nn]] if ids is not None else [])
            in_slot: Optional[Tensor] = None
            if with_grad:
                if out is not None:
                    send.append(out)
                if s >= 1 and n:  # the partial dk of this chunk from ranks j .. rank-1
                    in_slot = dk_free.pop()
                    recv.append(in_slot[:n])
                elif s == 0 and c >= 1:  # chunk c-1 of our own block, complete
                    xo = plan.chunk(own, c - 1)
                    if xo.stop > xo.start:
                        recv.append(dk[xo])
            pending = ring.shift(send, recv) if (send or recv) else None
            acc_slot: Optional[Tensor] = None
            if n:
                acc = None
                if with_grad:
                    acc_slot = dk_free.pop()
                    acc = acc_slot[:n].zero_()
                step_loss, step_g = backend.sigmoid_pass(
                    q, kx, scale, bias,
                    q_ids=ids, k_ids=ix,
                    diagonal=-x.start if j == rank else None,  # row i pairs with block row i
                    dq_acc=dq, dk_acc=acc,
                )
                loss += step_loss
                g_sum += step_g
            got = pending.wait() if pending is not None else []
            if out_slot is not None:  # sent: the slot is free again
                dk_free.append(out_slot)
            out, out_slot = None, None
            if acc_slot is not None:
                acc = acc_slot[:n]
                if dk_weight is not None:
                    acc.mul_(dk_weight)
                if in_slot is not None:
                    out, out_slot = in_slot[:n].add_(acc), in_slot
                    dk_free.append(acc_slot)
                else:
                    out, out_slot = acc, acc_slot
            if s < world - 1:
                kx = got[0] if nn else None
                ix = (got[1] if nn else None) if ids is not None else None
    if with_grad:
        # The last position's result is chunk C-1 of block rank+1, complete: send it home; ours arrives.
        xo = plan.chunk(own, plan.chunks - 1)
        send = [out] if out is not None else []
        recv = [dk[xo]] if xo.stop > xo.start else []
        if send or recv:
            ring.shift(send, recv).wait()
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
    def forward(ctx, q, k, scale, bias, ids, ring, sizes, backend, plan, norm: float):
        ct = compute_dtype(q.dtype)
        loss, dq, dk, g_sum = _ring_pass(ring, sizes, q, k, ids, scale, bias, backend, plan, with_grad=True)
        d_scale = torch.dot(q.reshape(-1).to(ct), dq.reshape(-1)).mul_(norm)
        factor = scale * norm
        dq.mul_(factor)
        dk.mul_(factor)
        ctx.in_dtype = q.dtype
        ctx.ring, ctx.sizes, ctx.backend, ctx.plan, ctx.ids, ctx.norm = ring, sizes, backend, plan, ids, norm
        ctx.save_for_backward(q, k, scale, bias, dq, dk, d_scale, g_sum.mul_(norm))
        return loss * norm  # out of place: see tiled_lse.positive_logits

    @staticmethod
    @first_order
    @autocast_off
    def backward(ctx, grad):
        q, k, scale, bias, dq, dk, d_scale, d_bias = ctx.saved_tensors
        g = grad.to(dq.dtype)
        ring = ctx.ring
        if ring.world > 1:
            import torch.distributed as dist

            mine = g.detach().reshape(1).to(torch.float64)
            every = [torch.empty_like(mine) for _ in range(ring.world)]
            dist.all_gather(every, mine, group=ring.group)
            differ = any(not torch.equal(x, mine) for x in every)
            del mine, every  # not alive during the products below (the peak of the backward)
            if differ:  # same decision on every rank
                _, _, dk_w, _ = _ring_pass(
                    ring, ctx.sizes, q, k, ctx.ids, scale, bias, ctx.backend, ctx.plan,
                    with_grad=True, with_dq=False, dk_weight=g,
                )
                return ((dq * g).to(ctx.in_dtype), dk_w.mul_(scale * ctx.norm).to(ctx.in_dtype), d_scale * g,
                        d_bias * g, None, None, None, None, None, None)
        return ((dq * g).to(ctx.in_dtype), (dk * g).to(ctx.in_dtype), d_scale * g, d_bias * g,
                None, None, None, None, None, None)


def ring_siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    scale,
    bias,
    *,
    labels: Optional[Tensor] = None,
    group,
    backend="auto",
    chunk_rows: Optional[int] = None,
) -> Tensor:
    """The global sigmoid loss on every rank, back-propagating this rank's share (see the module docstring).

    Every rank of ``group`` must call it (a collective). Invalid input on any rank raises the same
    ``ValueError`` on every rank instead of leaving the others waiting. ``chunk_rows`` (a positive
    int, the same on every rank) overrides the memory rule's chunk size (tests, tuning).
    """
    group = require_group(group, "siglip")
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
        bad_chunk = not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1
        if chunk_rows is not None and bad_chunk:
            raise ValueError(f"chunk_rows must be None or a positive int, got {chunk_rows!r}")
        refuse_transformed("the ring losses", image_features, text_features, s, b)
    except Exception as exc:  # any local failure is shared below, so no rank is left waiting
        error = error_message(exc)
    ok = error is None
    # the gradient ring sends more messages than the loss-only one: every rank must run the same
    needs_grad = ok and torch.is_grad_enabled() and any(t.requires_grad for t in (image_features, text_features, s, b))
    table = agree(
        ring,
        device,
        {
            "needs_grad": float(needs_grad),
            "rows": image_features.shape[0] if ok else 0,
            "dim": image_features.shape[1] if ok else 0,
            "dtype": dtype_code(image_features.dtype) if ok else 0,
            "labels": float(labels is not None),
            "scale": float(s.detach()) if ok else 0.0,
            "bias": float(b.detach()) if ok else 0.0,
            "chunk_rows": float(chunk_rows or 0) if ok else 0.0,
            # the chunking follows the backend's workspace rule: configured alike, or no rank runs
            "backend_config": float(_config_code(impl)) if ok else 0.0,
        },
        same=("needs_grad", "dim", "dtype", "labels", "scale", "bias", "chunk_rows", "backend_config"),
        local_error=error,
        what="siglip_loss",
        p2p=True,
        shown={
            "needs_grad": ("whether a gradient is wanted (grad mode on and an input that requires grad)",
                           lambda v: repr("yes" if v else "no")),
            "labels": ("whether labels are given", lambda v: "labels" if v else "None"),
            "chunk_rows": ("chunk_rows", lambda v: str(int(v)) if v else "None"),
            "backend_config": ("the backend's type and settings (e.g. workspace_bytes)", lambda v: f"#{int(v):08x}"),
        },
    )
    sizes = [int(v) for v in table["rows"]]
    norm = ring.world / sum(sizes)
    plan, impl = _plan_and_backend(impl, sizes, image_features, ids, needs_grad, chunk_rows)
    if needs_grad:
        return global_value(ring, _RingSigmoid.apply(image_features, text_features, s, b, ids, ring, sizes, impl, plan, norm))
    loss, _, _, _ = _ring_pass(ring, sizes, image_features, text_features, ids, s, b, impl, plan, with_grad=False)
    return global_value(ring, loss * norm)


_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _config_code(backend: object) -> int:
    """A 32-bit code of the backend's configuration, exchanged so that ranks whose plans would
    differ raise instead of exchanging messages of different sizes: its type, and for a dataclass
    backend the fields holding plain settings (numbers, strings, dtypes; not objects, devices or
    callables, whose reprs differ between processes)."""
    kind = type(backend)
    parts = [f"{kind.__module__}.{kind.__qualname__}"]
    if dataclasses.is_dataclass(backend):
        for f in dataclasses.fields(backend):
            v = getattr(backend, f.name)
            plain = isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v))
            parts.append(f"{f.name}={v!r}" if plain else f"{f.name}:{type(v).__qualname__}")
    return zlib.crc32(";".join(parts).encode())


def _plan_and_backend(backend, sizes, q: Tensor, ids: Optional[Tensor], with_grad: bool, chunk_rows: Optional[int]):
    """The plan of the memory rule, and the backend told its share W' (when it can be told)."""
    d = q.shape[1]
    need = getattr(backend, "workspace_for", None)
    if need is not None:
        workspace = need(q.shape[0], q.shape[0], d, q.dtype, q.device)
        common = need(max(sizes), max(sizes), d, q.dtype, q.device)
    else:
        workspace = common = _DEFAULT_WORKSPACE
    plan = plan_ring(
        sizes, d, q.dtype, with_grad=with_grad, workspace=workspace, chunk_workspace=common,
        id_itemsize=ids.element_size() if ids is not None else 0, chunk_rows=chunk_rows,
    )
    shrink = getattr(backend, "with_workspace", None)
    if shrink is not None and plan.world > 1:
        backend = shrink(plan.backend_workspace)
    return plan, backend
