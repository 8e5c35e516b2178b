"""Forward Triton kernel: row and column log-sum-exp of ``S = scale * q @ k.T`` in ONE pass.

Grid and partials
-----------------
The (row-block x col-block) tile grid is cut into ``RG x CG`` rectangles, one program each
(2-4 programs per SM). Program ``(rg, cg)`` walks its row blocks (outer loop) and, for each,
its column blocks (inner loop):

* row statistics of the current row block live in registers as a running ``(m, l)`` pair and
  are written once per row block as a partial LSE into ``row_part[cg, rows]``;
* column statistics are read-modify-written per tile in ``col_part[rg, cols]`` (a partial LSE
  per (row group, column)); only this program touches that slice, so no atomics are needed.
  The old partial is each column's reference for the tile (see :func:`_fold_tile`).

The host merges the ``CG`` (resp. ``RG``) partials with one ``torch.logsumexp``. Workspace:
``4 * (CG * B + RG * N)`` bytes (48 MiB at B = N = 262144 with 22 x 24 groups); no B x N tensor.

Numerics
--------
Everything after the dot is fp32 in base 2 (``s2 = S * log2(e)``, ``exp2``/``log2``), with a
running max per row and, per column, a reference that bounds the tile's logits within 2^64
(else the exact per-tile column max), so logits of 1e4 stay exact. NaN propagates: even where
``tl.maximum`` drops a NaN, the NaN reaches the sum of ``exp2`` terms and, from there, the
LSE. Masked entries are ``-inf``; every valid row/column has at least one valid entry in every
tile it meets, so no ``-inf - -inf`` is ever formed for a stored value.

FLOPs: ``2*B*N*D`` (the dots) plus two ``exp2`` per logit (one per direction).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import kernels_imported

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _tile_logits2(
    q_ptr, k_ptr, rows, cols, rmask, cmask, D, stride_q, stride_k, scale2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr,
):
    """``scale * log2(e) * q[rows] @ k[cols].T`` as a fp32 (BLOCK_M, BLOCK_N) tile, D in chunks.
    ``EVEN``: no row, column or D tail anywhere in the launch, so the loads take no masks."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_q
    k_rows = k_ptr + cols.to(tl.int64)[:, None] * stride_k
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        if EVEN:
            a = tl.load(q_rows + offs_d[None, :])
            b = tl.load(k_rows + offs_d[None, :])
        else:
            dmask = offs_d < D
            a = tl.load(q_rows + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
            b = tl.load(k_rows + offs_d[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), tl.trans(b.to(DOT_DTYPE)), acc, input_precision=PRECISION)
    return acc * scale2


@triton.jit
def _fold_tile(
    s2, rmask, cmask, m_row, l_row, col_old,
    ROWS: tl.constexpr, COLS: tl.constexpr, ONE_EXP: tl.constexpr, COL_REF: tl.constexpr, EVEN: tl.constexpr,
):
    """Fold one tile of base-2 logits into the running row ``(m_row, l_row)`` (registers) and
    return the new row pair and the new column partial LSEs (``col_old`` merged with the tile).

    Columns (``COL_REF``): the reference of column j is its running partial ``col_old[j]`` (this
    program's LSE over its earlier row blocks), so the tile needs ONE cross-warp vector reduction
    (the column sum of ``exp2(s - col_old)``) instead of a column max, its broadcast and a sum.
    Exact whenever no logit of the tile exceeds its column's partial by more than 64 (log2
    units): the sum cannot overflow, and a term lost to underflow is < 2^-126 of the partial's
    own term (which is 1). Otherwise (a column's first tile, where ``col_old = -inf``, or a
    jump) the tile takes the exact two-reduction path.
    """
    neg_inf = float("-inf")
    if not EVEN:
        # One mask for both directions: a masked entry is -inf, so it adds exp2(-inf) = 0 to every
        # sum; rows or columns that are entirely masked give NaN statistics but are never stored.
        s2 = tl.where(rmask[:, None] & cmask[None, :], s2, neg_inf)
    if ROWS and COLS and ONE_EXP:
        # One exp2 per logit for both directions: e = exp2(s - r_i) with r_i the tile's row max.
        # Row i: sum_j exp2(s_ij - m) = exp2(r_i - m) * sum_j e_ij.
        # Column j: sum_i exp2(s_ij - M) = sum_i e_ij * exp2(r_i - M), M the tile max: exact while
        # every column max is within 64 (log2 units) of M (terms lost to underflow are then
        # < 2^-62 of their column's largest term); otherwise the tile takes the two-exp path.
        r = tl.max(s2, axis=1)
        r_safe = tl.where(rmask, r, 0.0)
        e = tl.exp2(s2 - r_safe[:, None])
        m_new = tl.maximum(m_row, r)
        l_row = l_row * tl.exp2(m_row - m_new) + tl.sum(e, axis=1) * tl.exp2(r - m_new)
        m_row = m_new
        c = tl.max(s2, axis=0)
        top = tl.max(r, axis=0)
        spread = top - tl.min(tl.where(cmask, c, top), axis=0)
        if spread < 64.0:
            a = tl.where(rmask, tl.exp2(r - top), 0.0)  # <= 1; masked rows add nothing
            tile_lse = top + tl.log2(tl.sum(e * a[:, None], axis=0))
        else:
            tile_lse = c + tl.log2(tl.sum(tl.exp2(s2 - c[None, :]), axis=0))
        hi = tl.maximum(col_old, tile_lse)
        col_new = hi + tl.log2(tl.exp2(col_old - hi) + tl.exp2(tile_lse - hi))
    else:
        r = tl.max(s2, axis=1)  # the tile's row maxima (a reduction inside each warp)
        if ROWS:
            m_new = tl.maximum(m_row, r)
            l_row = l_row * tl.exp2(m_row - m_new) + tl.sum(tl.exp2(s2 - m_new[:, None]), axis=1)
            m_row = m_new
        col_new = col_old
        if COLS:
            if COL_REF:
                # max_ij (s_ij - col_old_j) <= max(s) - min(col_old): two scalar reductions; a
                # column's first tile (col_old = -inf) always jumps.
                jump = tl.max(r, axis=0) - tl.min(col_old, axis=0) > 64.0
            else:
                jump = True
            if jump:
                m_col = tl.max(s2, axis=0)
                tile_lse = m_col + tl.log2(tl.sum(tl.exp2(s2 - m_col[None, :]), axis=0))
                hi = tl.maximum(col_old, tile_lse)
                col_new = hi + tl.log2(tl.exp2(col_old - hi) + tl.exp2(tile_lse - hi))
            else:
                col_new = col_old + tl.log2(1.0 + tl.sum(tl.exp2(s2 - col_old[None, :]), axis=0))
    return m_row, l_row, col_new


@triton.jit
def lse_fwd_kernel(
    q_ptr, k_ptr, scale_ptr, row_part_ptr, col_part_ptr,
    B, N, D, stride_q, stride_k,
    row_blocks_per_group, col_blocks_per_group,
    ROWS: tl.constexpr, COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    ONE_EXP: tl.constexpr, COL_REF: tl.constexpr, EVEN: tl.constexpr,
):
    """Partial base-2 LSEs: ``row_part[cg, i]`` over the columns of group cg and
    ``col_part[rg, j]`` over the rows of group rg (``col_part`` must start at -inf)."""
    rg = tl.program_id(0)
    cg = tl.program_id(1)
    scale2 = tl.load(scale_ptr).to(tl.float32) * LOG2E
    n_row_blocks = tl.cdiv(B, BLOCK_M)
    n_col_blocks = tl.cdiv(N, BLOCK_N)
    rb_start = rg * row_blocks_per_group
    rb_end = tl.minimum(rb_start + row_blocks_per_group, n_row_blocks)
    cb_start = cg * col_blocks_per_group
    cb_end = tl.minimum(cb_start + col_blocks_per_group, n_col_blocks)
    neg_inf = float("-inf")
    for rb in range(rb_start, rb_end):
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < B
        m_row = tl.full((BLOCK_M,), neg_inf, dtype=tl.float32)
        l_row = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for cb in range(cb_start, cb_end):
            cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < N
            col_ptrs = col_part_ptr + rg.to(tl.int64) * N + cols
            col_old = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if COLS:
                # Issued before the dots, so its latency hides behind them. Masked columns read 0
                # (not -inf): they then never force the tile onto the two-reduction path.
                col_old = tl.load(col_ptrs, mask=cmask, other=0.0)
            s2 = _tile_logits2(
                q_ptr, k_ptr, rows, cols, rmask, cmask, D, stride_q, stride_k, scale2,
                BLOCK_M, BLOCK_N, BLOCK_D, DOT_DTYPE, PRECISION, EVEN,
            )
            m_row, l_row, col_new = _fold_tile(s2, rmask, cmask, m_row, l_row, col_old, ROWS, COLS, ONE_EXP, COL_REF, EVEN)
            if COLS:
                # Only this program touches this slice; its next read (a later row block) may come
                # from another thread of the program.
                tl.store(col_ptrs, col_new, mask=cmask)
                tl.debug_barrier()
        if ROWS:
            tl.store(row_part_ptr + cg.to(tl.int64) * B + rows, m_row + tl.log2(l_row), mask=rmask)


kernels_imported(__name__, lse_fwd_kernel)  # interpreted or compiled: fixed by @triton.jit at import
