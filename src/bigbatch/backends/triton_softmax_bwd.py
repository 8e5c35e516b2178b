"""Backward Triton kernels: the logits gradient of one super-tile, and the two products.

For a super-tile of ``TM`` query rows x ``TN`` key rows (by default 8192 x 4096 for half inputs, 4096 x 4096 for fp32):

1. :func:`dlogits_kernel` recomputes ``S = scale * q_i @ k_j.T`` tile by tile (the same
   D-chunked dot as the forward) and writes
   ``dS = g_row * exp(S - lse_row) + g_col * exp(S - lse_col) + g_pos * [j == label_i]``
   (the positive term folded in fp32 before rounding: it cancels the rest as P_ii -> 1)
   into a bounded workspace
   (bf16 for half inputs: 64 MiB; fp32 for fp32 inputs: 64 MiB, plus its transpose). FLOPs ``2*TM*TN*D``.
2. :func:`matmul_acc_kernel` twice: ``dq_acc[i] += dS @ k_j`` and ``dk_acc[j] += dS.T @ q_i``,
   fp32 accumulators, operands on tensor cores. FLOPs ``4*TM*TN*D``.

Each step is compute-bound (2*D FLOPs per workspace element written or read: 1024 per
2 bytes at D = 512, above the H200's ~200 FLOP/byte balance point), and the workspace is
mostly L2-resident between the writer and the readers. Total backward work: ``6*B*N*D``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import kernels_imported
from .triton_softmax_fwd import LOG2E, _tile_logits2


@triton.jit
def dlogits_kernel(
    q_ptr, k_ptr, scale_ptr, lse_row_ptr, lse_col_ptr, g_row_ptr, g_col_ptr, pos_ptr, g_pos_ptr, ds_ptr, dst_ptr,
    TM, TN, D, COL_OFF, stride_q, stride_k, stride_ds, stride_dst,
    HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr, HAS_POS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    ONE_EXP: tl.constexpr, WRITE_T: tl.constexpr, EVEN: tl.constexpr,
):
    """``ds[r, c]`` (and, with ``WRITE_T``, ``dst[c, r]``) for the ``TM x TN`` super-tile whose q, k,
    lse, g and pos pointers are offset to its first row / column. ``pos`` holds each row's positive
    key as an index into this call's key set (outside [0, N): none); ``COL_OFF`` is the super-tile's first key.
    Entries outside ``TM x TN`` are not written."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < TM
    cmask = cols < TN
    scale2 = tl.load(scale_ptr).to(tl.float32) * LOG2E
    s2 = _tile_logits2(
        q_ptr, k_ptr, rows, cols, rmask, cmask, D, stride_q, stride_k, scale2,
        BLOCK_M, BLOCK_N, BLOCK_D, DOT_DTYPE, PRECISION, EVEN,
    )
    if HAS_ROW:
        lse_r = tl.load(lse_row_ptr + rows, mask=rmask, other=0.0) * LOG2E
        g_r = tl.load(g_row_ptr + rows, mask=rmask, other=0.0)
    if HAS_COL:
        lse_c = tl.load(lse_col_ptr + cols, mask=cmask, other=0.0) * LOG2E
        g_c = tl.load(g_col_ptr + cols, mask=cmask, other=0.0)
    if HAS_ROW and HAS_COL:
        p = tl.exp2(s2 - lse_r[:, None])
        if ONE_EXP:
            # exp2(s - C_j) = p_ij * exp2(L_i - C_j), an outer product: one exp2 per logit. Exact
            # while |L_i - C_j| <= 64 over the tile (a p lost to underflow then stands for a
            # column-softmax term < 2^-62); otherwise the tile takes the two-exp path.
            l_hi = tl.max(tl.where(rmask, lse_r, float("-inf")), axis=0)
            l_lo = tl.min(tl.where(rmask, lse_r, float("inf")), axis=0)
            c_hi = tl.max(tl.where(cmask, lse_c, float("-inf")), axis=0)
            c_lo = tl.min(tl.where(cmask, lse_c, float("inf")), axis=0)
            if (l_hi - c_lo <= 64.0) & (c_hi - l_lo <= 64.0):
                u = tl.where(rmask, tl.exp2(lse_r - l_hi), 0.0)
                v = tl.where(cmask, tl.exp2(l_hi - lse_c), 0.0) * g_c
                ds = p * (g_r[:, None] + u[:, None] * v[None, :])
            else:
                ds = p * g_r[:, None] + tl.exp2(s2 - lse_c[None, :]) * g_c[None, :]
        else:
            ds = p * g_r[:, None] + tl.exp2(s2 - lse_c[None, :]) * g_c[None, :]
    elif HAS_ROW:
        ds = tl.exp2(s2 - lse_r[:, None]) * g_r[:, None]
    elif HAS_COL:
        ds = tl.exp2(s2 - lse_c[None, :]) * g_c[None, :]
    else:
        ds = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_POS:
        lab = tl.load(pos_ptr + rows, mask=rmask, other=-1) - COL_OFF
        g_p = tl.load(g_pos_ptr + rows, mask=rmask, other=0.0)
        ds += tl.where(lab[:, None] == cols[None, :], g_p[:, None], 0.0)
    mask = rmask[:, None] & cmask[None, :]
    out = ds.to(ds_ptr.dtype.element_ty)
    tl.store(ds_ptr + rows.to(tl.int64)[:, None] * stride_ds + cols[None, :], out, mask=mask)
    if WRITE_T:
        # A row-major copy of dS.T: the dk product then reads both operands K-major (fp32/TF32
        # tensor-core products need that on Hopper).
        tl.store(dst_ptr + cols.to(tl.int64)[None, :] * stride_dst + rows[:, None], out, mask=mask)


kernels_imported(__name__, dlogits_kernel)  # interpreted or compiled: fixed by @triton.jit at import


@triton.jit
def _matmul_acc_tile(
    a_ptr, b_ptr, c_ptr, M, N, K, pid,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Output tile number ``pid`` of ``c[M, N] += a[M, K] @ b[K, N]`` (grouped tile order)."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: programs that run together share rows of a and columns of b in L2.
    width = GROUP_M * grid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(
            b_cols + offs_k.to(tl.int64)[:, None] * stride_bk, mask=kmask[:, None] & nmask[None, :], other=0.0
        )
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=PRECISION)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    cmask = mmask[:, None] & nmask[None, :]
    tl.store(c_ptrs, tl.load(c_ptrs, mask=cmask, other=0.0) + acc, mask=cmask)


@triton.jit
def matmul_acc_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """``c[M, N] += a[M, K] @ b[K, N]`` with ``c`` fp32 (unit column stride) and fp32 accumulation;
    ``a`` and ``b`` are cast to ``DOT_DTYPE`` for the dot (any strides, so ``a`` may be a
    transposed view). One program per output tile."""
    _matmul_acc_tile(
        a_ptr, b_ptr, c_ptr, M, N, K, tl.program_id(0),
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
        BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_DTYPE, PRECISION,
    )


@triton.jit
def matmul_acc_pair_kernel(
    a1_ptr, b1_ptr, c1_ptr, M1, K1, stride_a1m, stride_a1k, stride_b1k, stride_b1n, stride_c1m,
    a2_ptr, b2_ptr, c2_ptr, M2, K2, stride_a2m, stride_a2k, stride_b2k, stride_b2n, stride_c2m,
    N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Both backward products of a super-tile in ONE launch: ``c1 += a1 @ b1`` (M1 x N, depth K1)
    and ``c2 += a2 @ b2`` (M2 x N, depth K2). Each product alone has only ``TM*D/(BM*BN)`` output
    tiles (128 at 4096 x 512 with 128 x 128 tiles: one partial wave on 132 SMs); together they
    fill the GPU twice as well. Programs ``[0, tiles1)`` do the first product, the rest the second."""
    pid = tl.program_id(0)
    tiles1 = tl.cdiv(M1, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if pid < tiles1:
        _matmul_acc_tile(
            a1_ptr, b1_ptr, c1_ptr, M1, N, K1, pid,
            stride_a1m, stride_a1k, stride_b1k, stride_b1n, stride_c1m,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_DTYPE, PRECISION,
        )
    else:
        _matmul_acc_tile(
            a2_ptr, b2_ptr, c2_ptr, M2, N, K2, pid - tiles1,
            stride_a2m, stride_a2k, stride_b2k, stride_b2n, stride_c2m,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, DOT_DTYPE, PRECISION,
        )
