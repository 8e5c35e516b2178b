"""The ring for softmax losses (CLIP, InfoNCE): exact LSE statistics over a sharded global batch.

Each rank holds queries ``q`` (b_r x D) and keys ``k`` (n_r x D). Logits are
``S = scale * q_all @ k_all.T`` over the global batch. :class:`RingSoftmax` returns,
for this rank, the global row LSEs of its queries, (CLIP) the global column LSEs
of its keys, and the positive logits ``S_{i, y_i}`` of its queries, where the label
``y_i`` indexes the global key set. Losses are assembled from these with plain
autograd in :func:`ring_clip_loss` / :func:`ring_infonce_loss`.

Forward (``world`` steps): the key block held at step ``t`` is sent on to the next
rank while ``backend.lse`` runs on it (row LSEs merge locally by logaddexp; positive
logits of labels that fall in this block are taken now). The block's partial column
LSE travels one step BEHIND the keys: the accumulator for block ``j`` finished at step
``t`` is sent during step ``t + 1``, overlapped with compute, and merged by the receiver
after its own partial for block ``j``. One final shift brings each block's complete column
LSE home. Extra memory: one incoming key block plus O(b + n) statistics.

Backward (``world`` steps): key blocks travel again with what their columns need
(``lse_col``, ``g_col``), and an fp32 ``dk`` accumulator travels one step behind,
as above; ``dq`` accumulates locally in fp32. Backend calls are chunked so that each
call's fp32 ``dq``/``dk`` outputs stay small. Extra memory (fp32): ``dq`` (b x D), two
``dk`` accumulators (one arriving, one leaving; n x D each), one incoming key block and
the chunk outputs: O((b + n) * D). FLOPs per rank: 8 * b_r * N * D, as on one GPU.

Semantics (DESIGN.md section 2): each rank's backward returns the gradient of the SUM
over ranks of every rank's outputs weighted by its upstream gradients, w.r.t. its local
features; ``d(scale)`` is this rank's share (its rows x all columns), NOT all-reduced,
so that DDP-style averaging over ranks gives the single-process gradient. Every rank
of the group must run the forward and the backward (they are collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..backends.base import TileBackend, compute_dtype
from .ring import Ring

# fp32 bytes of one backward chunk's dq or dk output (the backend allocates them per call).
_GRAD_CHUNK_BYTES = 32 << 20


def grad_chunk_rows(d: int) -> int:
    """Rows per backward backend call: ``_GRAD_CHUNK_BYTES`` of fp32 gradient, at least 1024."""
    return max(1024, _GRAD_CHUNK_BYTES // (4 * d))


@dataclass
class RingPlan:
    """What every rank agreed on for one call (from :func:`bigbatch.distributed.ring.agree`)."""

    ring: Ring
    q_sizes: List[int]  # queries per group rank
    k_sizes: List[int]  # keys per group rank
    cols: bool  # also the column LSEs (CLIP: keys are the other modality)
    # pos_rows[j] / pos_cols[j]: local query rows whose positive key is in block j, and its
    # index inside block j (None when no label points into block j).
    pos_rows: List[Optional[Tensor]]
    pos_cols: List[Optional[Tensor]]
    chunk: int  # rows/cols per backward backend call


def _chunks(total: int, size: int) -> List[slice]:
    return [slice(s, min(s + size, total)) for s in range(0, total, size)]


def _positive(q: Tensor, blk: Tensor, rows: Tensor, cols: Tensor, ct: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """(q rows, key rows, unscaled dot products) for the labelled pairs in one block, in ``ct``."""
    qs = q.index_select(0, rows).to(ct)
    ks = blk.index_select(0, cols).to(ct)
    return qs, ks, (qs * ks).sum(dim=1)


class RingSoftmax(torch.autograd.Function):
    """``(lse_row (b,), lse_col (n,) or empty, pos (b,))`` over the global batch; see the module doc."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, scale: Tensor, plan: RingPlan, backend: TileBackend):
        ring, cols = plan.ring, plan.cols
        ct = compute_dtype(q.dtype)
        q, k, scale_d = q.detach(), k.detach(), scale.detach()
        b, d = q.shape
        lse_row: Optional[Tensor] = None
        pos = torch.zeros(b, dtype=ct, device=q.device)
        blk = k
        acc_out: Optional[Tensor] = None  # complete-so-far column LSE of the previous step's block
        for t in range(ring.world):
            j = ring.block_at(t)
            send, recv = [], []
            if t < ring.world - 1:  # the keys go on to the next rank while we compute on them
                send.append(blk)
                recv.append(k.new_empty((plan.k_sizes[ring.block_at(t + 1)], d)))
            if cols and t >= 1:  # column statistics travel one step behind their keys
                send.append(acc_out)
                recv.append(q.new_empty((plan.k_sizes[j],), dtype=ct))
            pending = ring.shift(send, recv) if send else None

            row_part, col_part = backend.lse(q, blk, scale_d, rows=True, cols=cols)
            lse_row = row_part if lse_row is None else torch.logaddexp(lse_row, row_part)
            if plan.pos_rows[j] is not None:
                _, _, dots = _positive(q, blk, plan.pos_rows[j], plan.pos_cols[j], ct)
                pos.index_copy_(0, plan.pos_rows[j], dots * scale_d)

            got = pending.wait() if pending is not None else []
            if cols:
                acc_out = col_part if t == 0 else torch.logaddexp(got[-1], col_part)
            if t < ring.world - 1:
                blk = got[0]
        if cols:
            # acc_out now holds block (rank + 1)'s complete column LSE: send it home.
            if ring.world == 1:
                lse_col = acc_out
            else:
                lse_col = ring.shift([acc_out], [q.new_empty((k.shape[0],), dtype=ct)]).wait()[0]
        else:
            lse_col = q.new_empty((0,), dtype=ct)
        ctx.plan, ctx.backend = plan, backend
        ctx.save_for_backward(q, k, scale_d, lse_row, lse_col)
        return lse_row, lse_col, pos

    @staticmethod
    def backward(ctx, g_row: Tensor, g_col: Tensor, g_pos: Tensor):
        q, k, scale, lse_row, lse_col = ctx.saved_tensors
        plan: RingPlan = ctx.plan
        backend: TileBackend = ctx.backend
        ring, cols = plan.ring, plan.cols
        ct = compute_dtype(q.dtype)
        b, d = q.shape
        g_row = g_row.to(ct).contiguous()
        g_pos = g_pos.to(ct)
        dq = torch.zeros((b, d), dtype=ct, device=q.device)
        d_scale = torch.zeros((), dtype=ct, device=q.device)
        # What a key block's columns need, travelling with it.
        static: List[Tensor] = [k, lse_col, g_col.to(ct).contiguous()] if cols else [k]
        acc_out: Optional[Tensor] = None  # dk accumulator of the previous step's block (fp32)
        row_chunks = _chunks(b, plan.chunk)
        for t in range(ring.world):
            j = ring.block_at(t)
            n_j = plan.k_sizes[j]
            pend_static = None
            if t < ring.world - 1:
                n_next = plan.k_sizes[ring.block_at(t + 1)]
                bufs = [k.new_empty((n_next, d))]
                if cols:
                    bufs += [q.new_empty((n_next,), dtype=ct), q.new_empty((n_next,), dtype=ct)]
                pend_static = ring.shift(static, bufs)
            pend_acc = ring.shift([acc_out], [q.new_empty((n_j, d), dtype=ct)]) if t >= 1 else None
            kb = static[0]
            lcb, gcb = (static[1], static[2]) if cols else (None, None)

            acc: Optional[Tensor] = None
            for cs in _chunks(n_j, plan.chunk):
                dk_cs: Optional[Tensor] = None
                for rs in row_chunks:
                    dq_c, dk_c, ds_c = backend.lse_grad(
                        q[rs], kb[cs], scale, lse_row[rs], lcb[cs] if cols else None,
                        g_row[rs], gcb[cs] if cols else None, grad_dtype=ct,
                    )
                    dq[rs] += dq_c
                    d_scale += ds_c
                    dk_cs = dk_c if dk_cs is None else dk_cs.add_(dk_c)
                if acc is None:
                    # The incoming accumulator arrived during the first chunk; the outgoing one
                    # is released here, so at most two n x D fp32 accumulators are alive.
                    if pend_acc is not None:
                        acc = pend_acc.wait()[0]
                        pend_acc, acc_out = None, None
                    else:
                        acc = torch.zeros((n_j, d), dtype=ct, device=q.device)
                acc[cs] += dk_cs
            rows_j = plan.pos_rows[j]
            if rows_j is not None:  # positive logits: pos_i = s * q_i . k_{y_i}
                qs, ks, dots = _positive(q, kb, rows_j, plan.pos_cols[j], ct)
                gp = g_pos.index_select(0, rows_j)
                coef = (gp * scale)[:, None]
                dq.index_add_(0, rows_j, coef * ks)
                acc.index_add_(0, plan.pos_cols[j], coef * qs)
                d_scale += (gp * dots).sum()
            if pend_static is not None:
                static = pend_static.wait()
            acc_out = acc
        # acc_out holds block (rank + 1)'s complete dk: send it home.
        if ring.world == 1:
            dk = acc_out
        else:
            dk = ring.shift([acc_out], [q.new_empty(k.shape, dtype=ct)]).wait()[0]
        return dq.to(q.dtype), dk.to(k.dtype), d_scale.to(scale.dtype), None, None


def ring_softmax_stats(
    q: Tensor, k: Tensor, scale: Tensor, plan: RingPlan, backend: TileBackend
) -> Tuple[Tensor, Tensor, Tensor]:
    """Differentiable ``(lse_row, lse_col, pos)`` of this rank's queries/keys over the global batch."""
    return RingSoftmax.apply(q, k, scale, plan, backend)


def positive_index(
    labels: Tensor, k_sizes: Sequence[int], world: int
) -> Tuple[List[Optional[Tensor]], List[Optional[Tensor]]]:
    """Split global ``labels`` by the key block they point into: per block, (rows, index in block).

    One host sync (the per-block counts).
    """
    bounds = torch.tensor(list(_cumsum(k_sizes))[1:-1], dtype=labels.dtype, device=labels.device)
    block = torch.bucketize(labels, bounds, right=True)
    counts = torch.bincount(block, minlength=world).tolist()
    order = torch.argsort(block, stable=True)
    starts = list(_cumsum(k_sizes))
    rows: List[Optional[Tensor]] = []
    cols: List[Optional[Tensor]] = []
    for j, part in enumerate(torch.split(order, counts)):
        if counts[j] == 0:
            rows.append(None)
            cols.append(None)
        else:
            rows.append(part)
            cols.append(labels.index_select(0, part) - starts[j])
    return rows, cols


def _cumsum(sizes: Sequence[int]):
    total = 0
    yield 0
    for s in sizes:
        total += int(s)
        yield total
