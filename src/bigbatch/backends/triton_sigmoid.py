"""Triton backend for the sigmoid (SigLIP) loss: a fused logits kernel plus two GEMMs per tile.

Per workspace tile (``tile_rows x tile_cols`` of the M x N logits), one pass:

1. ``_siglip_tile_kernel`` (Triton): ``u = scale * q @ k.T + bias`` on the tensor cores with fp32
   accumulation, then in registers the loss ``softplus(-z u)`` and the logits gradient
   ``G = sigmoid(u) - [z = +1]``; it writes G once in the inputs' dtype (bf16/fp16/fp32) and one
   partial loss / partial ``sum G`` per program. The logits themselves never reach memory.
2. ``dq_acc += G @ k`` and ``dk_acc += G.T @ q`` with cuBLAS, fp32 output (``out_dtype``).

FLOPs: 2*M*N*D in the kernel + 4*M*N*D in the GEMMs = 6*M*N*D (2*M*N*D without gradients).
Memory traffic beyond the GEMMs' operands: G written once and read twice (6 bytes per logit in
bf16), against 6*D FLOPs per logit: compute-bound for D >= 64 on an H200.
Workspace: one G tile (512 MiB by default on a GPU, ``workspace_bytes``) and O(#programs) partials;
never M x N.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Tuple

import torch
from torch import Tensor

import triton
import triton.language as tl

from . import kernels_imported, triton_runs_on
from .base import compute_dtype, on_inputs_device
from .torch_sigmoid import check_ids
from .gemm import check_fp32_precision, fp32_dot_precision, fp32_matmul, mm_acc
from .torch_tiles import blocks

# Bytes of the G workspace tile chosen automatically (GPU); the interpreter uses small tiles.
_AUTO_TILE_BYTES = {"cuda": 1 << 29, "cpu": 1 << 16}


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    if FAST:  # one MUFU.EX2 (rel. error ~2^-22); subnormal results flush to 0
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _rcp(x, FAST: tl.constexpr):
    if FAST:  # one MUFU.RCP (1 ulp) instead of the range-checked division
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:  # one MUFU.LG2 (abs. error ~2^-22) instead of libdevice's polynomial
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit(do_not_specialize=["diagonal"])
def _siglip_tile_kernel(
    Q, K, G, QIDS, KIDS, LOSS_PART, GSUM_PART, SCALE, BIAS,
    M, N, D, diagonal,
    stride_qm, stride_kn, stride_gm,
    HAS_IDS: tl.constexpr, WRITE_G: tl.constexpr, EVEN_K: tl.constexpr, MASK_MN: tl.constexpr,
    PRECISION: tl.constexpr, FAST: tl.constexpr, G_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped program order: GROUP_M row blocks share their column blocks while those sit in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    # 64-bit row offsets: a tall tile (a small key chunk against many queries) passes 2^31 elements
    q_ptrs = Q + rm.to(tl.int64)[:, None] * stride_qm + rk[None, :]
    k_ptrs = K + rn.to(tl.int64)[:, None] * stride_kn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K and not MASK_MN:  # no tails anywhere in this launch: unmasked loads
            a = tl.load(q_ptrs)
            b = tl.load(k_ptrs)
        else:
            kmask = (k0 + rk) < D
            a = tl.load(q_ptrs, mask=mask_m[:, None] & kmask[None, :], other=0.0)
            b = tl.load(k_ptrs, mask=mask_n[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        q_ptrs += BLOCK_K
        k_ptrs += BLOCK_K

    u = acc * tl.load(SCALE) + tl.load(BIAS)
    if HAS_IDS:
        qi = tl.load(QIDS + rm, mask=mask_m, other=0)
        ki = tl.load(KIDS + rn, mask=mask_n, other=0)
        pos = qi[:, None] == ki[None, :]
    else:
        # An out-of-range ``diagonal`` (the launcher passes N) means: no positives.
        pos = (rn[None, :] - rm[:, None]) == diagonal
    # With t = z*u (z = +1 on positives, -1 elsewhere): loss softplus(-t), gradient w.r.t. u
    # G = -z * sigmoid(-t) (= sigmoid(u) - [z = +1], without cancellation for t >> 0).
    # Stable in both tails with one exp: e = exp(-|t|) in (0, 1].
    t = tl.where(pos, u, -u)
    e = _exp2(-tl.abs(t) * 1.4426950408889634, FAST)
    one_e = 1.0 + e
    r = _rcp(one_e, FAST)
    sig_neg_t = tl.where(t >= 0, e * r, r)
    g = tl.where(pos, -sig_neg_t, sig_neg_t)
    # softplus(-t) = max(-t, 0) + log1p(e); log1p by its series where 1 + e would round.
    log1p_e = tl.where(
        e < 1e-2, e * (1.0 - e * (0.5 - e * (0.3333333333333333 - 0.25 * e))), _log2(one_e, FAST) * 0.6931471805599453
    )
    loss = tl.maximum(-t, 0.0) + log1p_e
    if MASK_MN:
        valid = mask_m[:, None] & mask_n[None, :]
        g = tl.where(valid, g, 0.0)
        loss = tl.where(valid, loss, 0.0)
    tl.store(LOSS_PART + pid, tl.sum(tl.sum(loss, axis=1), axis=0))
    tl.store(GSUM_PART + pid, tl.sum(tl.sum(g, axis=1), axis=0))
    if WRITE_G:
        g_ptrs = G + rm.to(tl.int64)[:, None] * stride_gm + rn[None, :]
        g = g * G_SCALE  # fp16: |G| <= 1 lifted out of fp16's subnormal range (undone in the products)
        if MASK_MN:
            tl.store(g_ptrs, g.to(G.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
        else:
            tl.store(g_ptrs, g.to(G.dtype.element_ty))


kernels_imported(__name__, _siglip_tile_kernel)  # interpreted or compiled: fixed by @triton.jit at import


_TILE_ALIGN = 256  # a multiple of every BLOCK_M / BLOCK_N the configs use


def _align(side: int, total: int) -> int:
    """``side`` rounded down to a multiple of ``_TILE_ALIGN`` when it is short of ``total`` (>= 1)."""
    if side >= total:
        return total
    return side // _TILE_ALIGN * _TILE_ALIGN if side >= _TILE_ALIGN else max(1, side)


def _valid_block(block: object) -> bool:
    if not isinstance(block, tuple) or len(block) not in (5, 6):
        return False
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in block):
        return False
    pow2 = lambda v: v >= 1 and v & (v - 1) == 0  # noqa: E731
    return all(pow2(v) and v >= 16 for v in block[:3]) and pow2(block[3]) and block[4] >= 1 and (len(block) == 5 or block[5] >= 0)


@dataclass(frozen=True)
class TritonSigmoid:
    """Fused sigmoid-loss tiles on CUDA (or the Triton interpreter on CPU tensors).

    ``tile_rows``/``tile_cols``: the G workspace tile (``None``: automatic, 512 MiB on a GPU).
    ``fp32_precision``: ``"ieee"`` (exact fp32 products) or ``"tf32"`` for float32 features; ``None``
    (default): as a float32 ``torch.mm`` on CUDA at the time of the call (exact unless TF32 is allowed).
    ``block``: kernel config ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, maxnreg])`` or
    ``None`` (``maxnreg`` caps registers per thread so that two programs share an SM and one's
    epilogue overlaps the other's matrix products; 0 = no cap).
    ``fast_math``: on NVIDIA GPUs (PTX inline assembly; ignored on ROCm), exp2/reciprocal/log2 by single MUFU instructions (``*.approx.ftz``,
    errors ~2^-22, far below bf16/tf32 input rounding) instead of libdevice; the interpreter
    always uses the exact forms.
    ``workspace_bytes``: budget of the automatic G tile (``None``: ``_AUTO_TILE_BYTES`` for the
    device, 512 MiB on a GPU). The ring (:mod:`bigbatch.distributed.sigmoid`) lowers it by the bytes
    of its own buffers, so that one GPU and one rank of a ring use the same transient memory.
    Ignored for a side given by ``tile_rows``/``tile_cols``.
    """

    tile_rows: Optional[int] = None
    tile_cols: Optional[int] = None
    fp32_precision: Optional[str] = None
    block: Optional[Tuple[int, ...]] = None
    fast_math: bool = True
    name: str = field(default="triton", init=False)  # the backend's kind, not a setting
    workspace_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if isinstance(self.block, list):  # as a list before: kept working, stored as a tuple (hashable)
            object.__setattr__(self, "block", tuple(self.block))
        for arg in ("tile_rows", "tile_cols", "workspace_bytes"):
            value = getattr(self, arg)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"TritonSigmoid: {arg} must be a positive int or None, got {value!r}")
        check_fp32_precision("TritonSigmoid", "fp32_precision", self.fp32_precision)
        if self.block is not None and not _valid_block(self.block):
            raise ValueError(
                "TritonSigmoid: block must be a tuple (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, maxnreg]) of ints, "
                f"the three blocks powers of two >= 16, warps a power of two, stages >= 1, maxnreg >= 0; got {self.block!r}"
            )
        if not isinstance(self.fast_math, bool):
            raise TypeError(f"TritonSigmoid: fast_math must be a bool, got {self.fast_math!r}")

    def supports(self, device: torch.device) -> bool:
        return triton_runs_on(device, "sigmoid")

    def _config(self, dtype: torch.dtype, device: torch.device) -> Tuple[int, int, int, int, int, int]:
        if self.block is not None:
            return tuple(self.block) + (0,) * (6 - len(self.block))
        if device.type != "cuda":
            return (32, 32, 32, 4, 1, 0)  # interpreter: several programs and tails even on tiny inputs
        if dtype == torch.float32:
            return (128, 128, 32, 8, 3, 0)
        return (128, 128, 64, 8, 3, 0)

    def workspace_budget(self, device: torch.device) -> int:
        """Bytes the automatic G tile may take on ``device`` (``workspace_bytes`` or the default)."""
        return self.workspace_bytes or _AUTO_TILE_BYTES.get(device.type, 1 << 26)

    def workspace_for(self, m: int, n: int, d: int, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes of the G tile that ``sigmoid_pass`` allocates for an M x N problem with gradients."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        rows, cols = self._tiles(m, n, itemsize, device)
        return rows * cols * itemsize

    def with_workspace(self, nbytes: int) -> "TritonSigmoid":
        """This backend with a G-tile budget of ``nbytes`` (the ring's share of the memory rule)."""
        return replace(self, workspace_bytes=max(1, int(nbytes)))

    def _tiles(self, m: int, n: int, itemsize: int, device: torch.device) -> Tuple[int, int]:
        # A near-square tile of at most ``budget`` elements; when N is narrower than the square
        # (the ring's column chunks), the rows grow so that the tile still fills the budget.
        # A side cut short of M or N is a multiple of _TILE_ALIGN, so that only the last tile has
        # tails (masked loads); a budget that is not a power of two (the ring's) would break that.
        budget = max(1, self.workspace_budget(device) // itemsize)
        side = 1 << (budget.bit_length() // 2)
        rows = self.tile_rows or max(1, min(m, side))
        cols = self.tile_cols or _align(min(n, budget // rows), n)
        if self.tile_rows is None:
            rows = _align(max(rows, min(m, budget // cols)), m)
        return rows, cols

    @on_inputs_device
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
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"backend='triton' takes float16/bfloat16/float32 features, got {q.dtype}; use backend='torch'"
            )
        if not self.supports(q.device):
            raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
        ct = compute_dtype(q.dtype)
        m, n, d = q.shape[0], k.shape[0], q.shape[1]
        check_ids(q_ids, k_ids, m, n)
        q, k = q.contiguous(), k.contiguous()
        scale = scale.to(torch.float32).reshape(1)
        bias = bias.to(torch.float32).reshape(1)
        if q_ids is not None:
            q_ids, k_ids = q_ids.contiguous(), k_ids.contiguous()
        write_g = dq_acc is not None or dk_acc is not None
        bm, bn, bk, warps, stages, maxnreg = self._config(q.dtype, q.device)
        launch_opts = {"num_warps": warps, "num_stages": stages}
        if maxnreg:
            launch_opts["maxnreg"] = maxnreg
        tr, tc = self._tiles(m, n, q.element_size(), q.device)
        work = torch.empty(tr * tc if write_g else 1, dtype=q.dtype, device=q.device)
        max_programs = triton.cdiv(min(tr, m), bm) * triton.cdiv(min(tc, n), bn)
        parts = torch.empty((2, max_programs), dtype=torch.float32, device=q.device)
        loss = torch.zeros((), dtype=ct, device=q.device)
        g_sum = torch.zeros((), dtype=ct, device=q.device)
        # input_precision only matters for fp32 operands (16-bit operands always use the tensor cores).
        precision = fp32_dot_precision(self.fp32_precision) if q.dtype == torch.float32 else "tf32"
        # G is stored in the features' dtype: in fp16, |G| < 6e-5 would lose bits and < 6e-8 vanish
        # (a trained model's negatives, before any loss scaling reaches them); stored times 2^15
        # (|G| <= 1, so <= 32768 < 65504) and products scaled back by exactly 2^-15
        g_scale = 2.0 ** 15 if q.dtype == torch.float16 else 1.0
        # the gradient products at the requested fp32 precision (set once for all tiles)
        with fp32_matmul(precision if q.dtype == torch.float32 else None):
            for rs in blocks(m, tr):
                tm = rs.stop - rs.start
                for cs in blocks(n, tc):
                    tn = cs.stop - cs.start
                    if q_ids is not None:
                        diag = 0
                    elif diagonal is None:
                        diag = tn  # out of range: no positives
                    else:
                        diag = diagonal + rs.start - cs.start
                    g_tile = work[: tm * tn].view(tm, tn) if write_g else work
                    grid = (triton.cdiv(tm, bm) * triton.cdiv(tn, bn),)
                    _siglip_tile_kernel[grid](
                        q[rs], k[cs], g_tile,
                        q_ids[rs] if q_ids is not None else q, k_ids[cs] if k_ids is not None else k,
                        parts[0], parts[1], scale, bias,
                        tm, tn, d, diag,
                        q.stride(0), k.stride(0), tn,
                        HAS_IDS=q_ids is not None, WRITE_G=write_g, EVEN_K=d % bk == 0,
                        MASK_MN=tm % bm != 0 or tn % bn != 0, PRECISION=precision, FAST=self.fast_math and q.is_cuda and torch.version.hip is None,
                        G_SCALE=g_scale,
                        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                        **launch_opts,
                    )
                    sums = parts[:, : grid[0]].sum(dim=1, dtype=ct)
                    loss += sums[0]
                    g_sum += sums[1]
                    if dq_acc is not None:
                        mm_acc(dq_acc[rs], g_tile, k[cs], alpha=1.0 / g_scale)
                    if dk_acc is not None:
                        mm_acc(dk_acc[cs], g_tile.t(), q[rs], alpha=1.0 / g_scale)
        return loss, g_sum
