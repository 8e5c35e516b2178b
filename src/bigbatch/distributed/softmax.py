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
(``lse_col``, ``g_col``); ``dq`` accumulates locally in fp32. The fp32 ``dk`` accumulator of a
block travels one step behind its keys, CHUNK BY CHUNK: a block is split into column chunks of
``plan.chunk`` keys, each backend call covers (row chunk x column chunk), and while chunk ``i``
of the visiting block is computed, chunk ``i`` of the previous block's accumulator leaves and
chunk ``i`` of this block's arrives (then the partial is added to it). The positive logits'
gradient goes into ``lse_grad`` (``pos_labels``/``g_pos``) for the chunk holding each
positive, so it joins dS in fp32 before dS is rounded (it cancels the LSE term near convergence). Extra memory per rank
(fp32 unless said): ``dq`` (b x D) + about one block's ``dk`` accumulator (n x D; chunks leave
as others arrive) + one incoming key block (input dtype) + one backend call's outputs and
workspace (2 chunks x D) -- O((b + n) * D), independent of the world size.
FLOPs per rank: 8 * b_r * N * D, as on one GPU; bytes sent per rank per call:
forward n*D*(input bytes) per step, backward n*D*(input bytes + 4) per step.

Semantics (the distributed contract, docs/ring.md): each rank's backward returns the gradient of the SUM
over ranks of every rank's outputs weighted by its upstream gradients, w.r.t. its local
features; ``d(scale)`` is this rank's share (its rows x all columns), NOT all-reduced,
so that DDP-style averaging over ranks gives the single-process gradient. Every rank
of the group must run the forward and the backward (they are collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..backends.torch_tiles import blocks
from ..backends.base import TileBackend, compute_dtype
from .ring import Ring
from .._amp import autocast_off
from .._autograd import first_order

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
    chunk: int  # rows/cols per backward backend call; key blocks are split into such chunks
    # pos[(j, i)] = (local query rows, their positive key's index inside chunk i of block j)
    # for every chunk that some label of this rank points into.
    pos: Dict[Tuple[int, int], Tuple[Tensor, Tensor]]
    labels: Tensor  # (b,) int64: each local query's positive in the GLOBAL key set

    def key_start(self, j: int) -> int:
        """Global index of key block ``j``'s first row."""
        return sum(self.k_sizes[:j])

    def keyblocks(self, j: int) -> List[slice]:
        """The column chunks of key block ``j`` (same on every rank)."""
        return blocks(self.k_sizes[j], self.chunk)


def _dots(q: Tensor, kc: Tensor, rows: Tensor, cols: Tensor, ct: torch.dtype) -> Tuple[Tensor, Tensor, Tensor]:
    """(q rows, key rows, unscaled dot products) of the labelled pairs in one key chunk, in ``ct``."""
    qs = q.index_select(0, rows).to(ct)
    ks = kc.index_select(0, cols).to(ct)
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
            for i, cs in enumerate(plan.keyblocks(j)):
                if (j, i) in plan.pos:
                    rows, idx = plan.pos[(j, i)]
                    _, _, dots = _dots(q, blk[cs], rows, idx, ct)
                    # out of place: torch 2.11's dynamo drops the gradient of a Function output
                    # written in place (tests/test_compile.py)
                    pos = pos.index_copy(0, rows, dots * scale_d)

            got = pending.wait() if pending is not None else []
            if cols:
                acc_out = col_part if t == 0 else torch.logaddexp(got[-1], col_part)
            if t < ring.world - 1:
                blk = got[0]
        if not cols:
            lse_col = q.new_empty((0,), dtype=ct)
        elif ring.world == 1:
            lse_col = acc_out
        else:  # acc_out holds block (rank + 1)'s complete column LSE: send it home
            lse_col = ring.shift([acc_out], [q.new_empty((k.shape[0],), dtype=ct)]).wait()[0]
        ctx.plan, ctx.backend = plan, backend
        ctx.save_for_backward(q, k, scale_d, lse_row, lse_col)
        return lse_row, lse_col, pos

    @staticmethod
    @first_order
    @autocast_off
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
        # The fp32 dk accumulator of a block is a list of per-chunk tensors, so that it can travel
        # chunk by chunk: a chunk leaves as soon as the same chunk of the next block arrives,
        # and at most about one block's accumulator (plus a chunk) is alive at a time.
        acc_out: List[Optional[Tensor]] = []  # previous step's block, to send on
        row_chunks = blocks(b, plan.chunk)
        for t in range(ring.world):
            j = ring.block_at(t)
            chunks = plan.keyblocks(j)
            pend_static = None
            if t < ring.world - 1:
                n_next = plan.k_sizes[ring.block_at(t + 1)]
                bufs = [k.new_empty((n_next, d))]
                if cols:
                    bufs += [q.new_empty((n_next,), dtype=ct), q.new_empty((n_next,), dtype=ct)]
                pend_static = ring.shift(static, bufs)
            kb = static[0]
            lcb, gcb = (static[1], static[2]) if cols else (None, None)
            rel = plan.labels - plan.key_start(j)  # positives' index in block j (any value)
            acc: List[Optional[Tensor]] = []
            for i in range(max(len(chunks), len(acc_out))):
                # chunk i of the previous block's accumulator -> next; chunk i of this block's <- prev
                send = [acc_out[i]] if i < len(acc_out) else []
                recv = [q.new_empty((chunks[i].stop - chunks[i].start, d), dtype=ct)] if t >= 1 and i < len(chunks) else []
                pending = ring.shift(send, recv) if (send or recv) else None
                dk_cs: Optional[Tensor] = None
                if i < len(chunks):
                    cs = chunks[i]
                    has_pos = (j, i) in plan.pos
                    for rs in row_chunks:
                        # The positive term joins dS inside the backend, in fp32, BEFORE dS is rounded
                        # and multiplied (near convergence it cancels the LSE term); labels outside
                        # this chunk mean "no positive here" to the backend.
                        pos_kw = {"pos_labels": rel[rs] - cs.start, "g_pos": g_pos[rs]} if has_pos else {}
                        dq_c, dk_c, ds_c = backend.lse_grad(
                            q[rs], kb[cs], scale, lse_row[rs], lcb[cs] if cols else None,
                            g_row[rs], gcb[cs] if cols else None, grad_dtype=ct, **pos_kw,
                        )
                        dq[rs] += dq_c
                        d_scale += ds_c
                        dk_cs = dk_c if dk_cs is None else dk_cs.add_(dk_c)
                got = pending.wait() if pending is not None else []
                if send:
                    acc_out[i] = None  # sent: release it
                if i < len(chunks):
                    acc.append(got[0].add_(dk_cs) if recv else dk_cs)
            if pend_static is not None:
                static = pend_static.wait()
            acc_out = acc
        # acc_out holds block (rank + 1)'s complete dk (world 1: this rank's): send it home.
        dk = k.new_empty(k.shape)
        own = plan.keyblocks(ring.rank)
        for i in range(max(len(own), len(acc_out))):
            if ring.world == 1:
                dk[own[i]] = acc_out[i]
                continue
            send = [acc_out[i]] if i < len(acc_out) else []
            recv = [q.new_empty((own[i].stop - own[i].start, d), dtype=ct)] if i < len(own) else []
            got = ring.shift(send, recv).wait()
            if send:
                acc_out[i] = None
            if recv:
                dk[own[i]] = got[0]
        return dq.to(q.dtype), dk, d_scale.to(scale.dtype), None, None


def ring_softmax_stats(
    q: Tensor, k: Tensor, scale: Tensor, plan: RingPlan, backend: TileBackend
) -> Tuple[Tensor, Tensor, Tensor]:
    """Differentiable ``(lse_row, lse_col, pos)`` of this rank's queries/keys over the global batch."""
    return RingSoftmax.apply(q, k, scale, plan, backend)


def positive_index(
    labels: Tensor, k_sizes: Sequence[int], chunk: int
) -> Dict[Tuple[int, int], Tuple[Tensor, Tensor]]:
    """Group global ``labels`` by the key chunk they point into: ``{(block, chunk): (rows, index)}``.

    One host sync (the per-chunk counts).
    """
    segments: List[Tuple[int, int, int]] = []  # (block, chunk, global start)
    start = 0
    for j, n in enumerate(k_sizes):
        for i, cs in enumerate(blocks(int(n), chunk)):
            segments.append((j, i, start + cs.start))
        start += int(n)
    bounds = torch.tensor([seg[2] for seg in segments[1:]], dtype=labels.dtype, device=labels.device)
    seg_of = torch.bucketize(labels, bounds, right=True)
    counts = torch.bincount(seg_of, minlength=len(segments)).tolist()
    order = torch.argsort(seg_of, stable=True)
    out: Dict[Tuple[int, int], Tuple[Tensor, Tensor]] = {}
    for (j, i, g0), rows, c in zip(segments, torch.split(order, counts), counts):
        if c:
            out[(j, i)] = (rows, labels.index_select(0, rows) - g0)
    return out


def own_positives(b: int, rank: int, chunk: int, device: torch.device) -> Dict[Tuple[int, int], Tuple[Tensor, Tensor]]:
    """CLIP's positives: row r of this rank pairs with key r of this rank's block (no sync)."""
    ar = torch.arange(b, device=device)
    return {(rank, i): (ar[cs], ar[: cs.stop - cs.start]) for i, cs in enumerate(blocks(b, chunk))}
