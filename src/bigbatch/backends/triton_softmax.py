"""Fused Triton tile backend (``backend="triton"``): the :class:`~bigbatch.backends.base.TileBackend`
protocol on CUDA GPUs (and on the CPU under ``TRITON_INTERPRET=1``, for tests).

* ``lse``: one kernel pass over all tiles (:mod:`.triton_softmax_fwd`) gives the row and the
  column LSE together; ``2*B*N*D`` FLOPs; workspace ``4*(CG*B + RG*N)`` bytes of partial LSEs.
* ``lse_grad``: super-tiles of at most 32 Mi logits (:mod:`.triton_softmax_bwd`): one kernel
  recomputes the tile and writes dS into a bounded workspace, two matmul kernels accumulate
  ``dS @ k`` and ``dS.T @ q`` in fp32; ``6*B*N*D`` FLOPs. Memory: the fp32 ``dq``
  accumulator (B x D), one fp32 ``dk`` accumulator per key super-block (TN x D), the dS
  workspace (64 MiB: 8192 x 4096 bf16, or 4096 x 4096 fp32 plus its transpose: 128 MiB) and the outputs.

Precision: bf16/fp16 operands on tensor cores with fp32 accumulation (the dS workspace is
bf16 for both: its exponent range keeps tiny probabilities times tiny upstream gradients);
fp32 operands in exact fp32 (``"ieee"``) or TF32 (``"tf32"``), by default as torch's CUDA matmuls
at the time of the call (:func:`~.gemm.fp32_dot_precision`: exact fp32 unless TF32 was allowed). All
softmax arithmetic is fp32. float64 is not supported (use ``backend="torch"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

import triton
import triton.language as tl

from . import triton_runs_on
from .base import compute_dtype, on_inputs_device
from .gemm import check_fp32_precision, fp32_dot_precision, mm_acc
from .triton_softmax_bwd import dlogits_kernel, matmul_acc_kernel, matmul_acc_pair_kernel
from .triton_softmax_fwd import lse_fwd_kernel

_PRODUCTS = ("separate", "pair", "cublas")
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_LN2 = math.log(2.0)


@dataclass(frozen=True)
class _Config:
    """Block shapes and launch settings for one (dtype, device) pair."""

    # forward (one-pass LSE) tiles
    block_m: int
    block_n: int
    block_d: int
    warps: int
    stages: int
    # backward dS tiles
    ds_block_m: int
    ds_block_n: int
    ds_block_d: int
    ds_warps: int
    ds_stages: int
    # backward products dS @ k, dS.T @ q
    mm_block_m: int
    mm_block_n: int
    mm_block_k: int
    mm_warps: int
    mm_stages: int
    super_rows: int  # dS workspace shape
    super_cols: int
    programs: int  # forward grid size to aim for
    one_exp: int = 0  # forward: 1 = one exp2 per logit for both directions (slower on an H200: docs/kernels.md)
    ds_one_exp: int = 0  # backward dS kernel: 1 = one exp2 per logit (outer-product form, exact fallback)
    col_ref: int = 1  # forward: columns referenced to their running partial (one cross-warp reduction per tile)
    kmajor: int = 0  # backward products read K-major operands (dS.T copy, transposed q/k chunks)
    # backward products: "separate" (two Triton launches), "pair" (both in one Triton launch),
    # "cublas" (two cuBLAS GEMMs with fp32 output; half inputs: fp32 inputs on a GPU raise, since
    # cuBLAS fp32 GEMMs follow torch's global TF32 flag instead of ``precision``)
    products: str = "separate"


# Opt-in shared memory per block by compute capability, for a torch whose device properties lack
# ``shared_memory_per_block_optin``; an unknown GPU is taken as the smallest of the tensor-core ones
_SHARED_MEMORY = {(7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912,
                  (8, 9): 101376, (9, 0): 232448}


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one block may use on ``device`` (opt-in maximum)."""
    props = torch.cuda.get_device_properties(device)
    known = getattr(props, "shared_memory_per_block_optin", None)
    return int(known) if known else _SHARED_MEMORY.get((props.major, props.minor), 101376)


def _gpu_config(dtype: torch.dtype, device: torch.device) -> _Config:
    """Defaults from the block-shape sweep on an H200 (``python -m bigbatch.bench.clip --tune``)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if dtype == torch.float32:
        # The paired fp32 product kernel (128 x 128 x 32, 8 warps) takes 128 KiB of shared memory in
        # 3 stages, over the 99 KiB of sm_86 / sm_89 (RTX 30xx / 40xx, A10, L4, L40S): 64 KiB in 2
        # (compiled for those targets with triton 3.9; every other default kernel fits there).
        mm_stages = 3 if shared_memory_per_block(device) >= 131072 else 2
        # TF32 tensor-core products need both operands K-major on Hopper: kmajor.
        return _Config(
            block_m=128, block_n=128, block_d=32, warps=4, stages=3,
            ds_block_m=128, ds_block_n=128, ds_block_d=32, ds_warps=4, ds_stages=3,
            mm_block_m=128, mm_block_n=128, mm_block_k=32, mm_warps=8, mm_stages=mm_stages,
            # 4096 x 4096 super-tiles (dS and dS.T: 2 x 64 MiB) and one launch for both products:
            # B = 8192 / 32768 / 262144, D = 512 in 2.95 / 25.1 / 1591 ms against 3.53 / 32.5 /
            # 2052 ms with 4096 x 2048 and two launches (benchmarks/results/probes/clip_fp32_ab_h200.json).
            super_rows=4096, super_cols=4096, programs=2 * sms, kmajor=1, products="pair",
        )
    return _Config(
        block_m=128, block_n=128, block_d=64, warps=4, stages=3,
        ds_block_m=128, ds_block_n=256, ds_block_d=64, ds_warps=8, ds_stages=3,
        mm_block_m=128, mm_block_n=64, mm_block_k=64, mm_warps=4, mm_stages=4,
        # 4 programs per SM: forward 46.1 vs 47.5 ms (2 per SM) at B = 131072 (probe v2).
        programs=4 * sms,
        # 8192 x 4096 super-tiles (bf16 dS: 64 MiB, the workspace the issue allows): half of 4096 x
        # 4096's launches, which the GPU waited for (three per super-tile, issued from Python):
        # fwd+bwd at D = 512, B = 32k / 64k / 256k in 10.6 / 41.6 / 640 ms against 14.1 / 42.8 / 715;
        # D = 128, B = 32k / 64k: 7.4 / 27.2 against 16.1 / 50.4 (8192 x 8192, 128 MiB: 2-20% faster
        # again; benchmarks/results/probes/clip_super_tile_ab_h200.json)
        super_rows=8192, super_cols=4096,
        # cuBLAS products: backward 129.7 ms vs 179.5 (two Triton launches) and 144.0 (paired launch)
        # at B = 131072, D = 512 on an H200 (benchmarks/results/probes/clip_kernel_probe_h200.json).
        products="cublas",
    )


def _interpreter_config() -> _Config:
    # Small blocks: the interpreter runs programs one by one in numpy.
    return _Config(
        block_m=32, block_n=32, block_d=16, warps=4, stages=1,
        ds_block_m=32, ds_block_n=32, ds_block_d=16, ds_warps=4, ds_stages=1,
        mm_block_m=32, mm_block_n=32, mm_block_k=32, mm_warps=4, mm_stages=1,
        super_rows=64, super_cols=48, programs=4,
    )


def _split(n_blocks: int, groups: int) -> Tuple[int, int]:
    """``(blocks_per_group, groups)`` with every group non-empty."""
    groups = max(1, min(groups, n_blocks))
    per = -(-n_blocks // groups)
    return per, -(-n_blocks // per)


@dataclass(frozen=True)
class TritonTiles:
    """Fused Triton kernels for the tiled LSE statistics and their gradients.

    Args:
        precision: dot precision for float32 inputs, ``"ieee"`` (exact fp32) or ``"tf32"``;
            ``None`` (default): as a float32 ``torch.mm`` on CUDA at the time of the call, i.e.
            exact unless TF32 is allowed (``torch.backends.cuda.matmul.fp32_precision = "tf32"``,
            ``allow_tf32 = True`` or ``torch.set_float32_matmul_precision("high")``). Half inputs
            always use tensor cores with fp32 accumulation.
        block_m, block_n, block_d: override the logits tile (rows, columns, D chunk); powers
            of two >= 16. ``None``: tuned defaults for the device.
        super_tile: override ``(rows, cols)`` of the backward's dS workspace.
        tune: override any other launch setting by its :class:`_Config` field name
            (``warps``, ``stages``, ``mm_block_m``, ...), for tuning runs.
    """

    precision: Optional[str] = None
    block_m: Optional[int] = None
    block_n: Optional[int] = None
    block_d: Optional[int] = None
    super_tile: Optional[Tuple[int, int]] = None
    tune: Optional[Dict[str, Any]] = field(default=None, compare=False, hash=False)
    name: str = field(default="triton", init=False)  # the backend's kind, not a setting

    def __post_init__(self) -> None:
        check_fp32_precision("TritonTiles", "precision", self.precision)
        for arg in ("block_m", "block_n", "block_d"):
            v = getattr(self, arg)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 16 or v & (v - 1)):
                raise ValueError(f"TritonTiles: {arg} must be a power of two >= 16 or None, got {v!r}")
        st = self.super_tile
        if st is not None and not (
            isinstance(st, tuple) and len(st) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in st)
        ):
            raise ValueError(f"TritonTiles: super_tile must be a (rows, cols) tuple of positive ints or None, got {st!r}")
        unknown = set(self.tune or {}) - set(_Config.__dataclass_fields__)
        if unknown:
            raise ValueError(f"TritonTiles: unknown tune keys {sorted(unknown)}; known: {sorted(_Config.__dataclass_fields__)}")
        products = (self.tune or {}).get("products", "separate")
        if products not in _PRODUCTS:
            raise ValueError(f"TritonTiles: tune['products'] must be one of {_PRODUCTS}, got {products!r}")

    # ------------------------------------------------------------------ helpers
    def supports(self, device: torch.device) -> bool:
        return triton_runs_on(device)

    def _config(self, dtype: torch.dtype, device: torch.device) -> _Config:
        base = _gpu_config(dtype, device) if device.type == "cuda" else _interpreter_config()
        over = dict(self.tune or {})
        for arg in ("block_m", "block_n", "block_d"):
            if getattr(self, arg):
                over.setdefault(arg, getattr(self, arg))
                over.setdefault("ds_" + arg, getattr(self, arg))
        if self.super_tile:
            over["super_rows"], over["super_cols"] = self.super_tile
        return _Config(**{**base.__dict__, **over})

    def _check(self, q: Tensor, k: Tensor, scale: Tensor) -> None:
        if q.dtype not in _SUPPORTED:
            raise TypeError(
                f"backend='triton' supports float16, bfloat16 and float32 features, got {q.dtype}; "
                f"use backend='torch' for float64"
            )
        if k.dtype != q.dtype:
            raise TypeError(f"backend='triton': q and k must share a dtype, got {q.dtype} and {k.dtype}")
        if q.dim() != 2 or k.dim() != 2 or q.shape[1] != k.shape[1]:
            raise ValueError(f"backend='triton': q (B, D) and k (N, D) expected, got {tuple(q.shape)} and {tuple(k.shape)}")
        if not self.supports(q.device) or k.device != q.device or scale.device != q.device:
            raise ValueError(
                f"backend='triton' needs q, k and scale on one CUDA device (or the CPU with TRITON_INTERPRET=1), "
                f"got {q.device}, {k.device}, {scale.device}"
            )

    def _dot(self, dtype: torch.dtype, device: torch.device) -> Tuple[tl.dtype, str]:
        """Operand dtype and input precision for the dots."""
        if device.type != "cuda":
            # The interpreter's bf16 dot is wrong; fp32 dots of up-cast operands are exact.
            return tl.float32, "ieee"
        if dtype == torch.float32:
            return tl.float32, fp32_dot_precision(self.precision)
        return _TL_DTYPE[dtype], "tf32"

    # ------------------------------------------------------------------ forward
    @on_inputs_device
    def lse(self, q: Tensor, k: Tensor, scale: Tensor, *, rows: bool, cols: bool):
        self._check(q, k, scale)
        ct = compute_dtype(q.dtype)
        b, n = q.shape[0], k.shape[0]
        if not (rows or cols):
            return None, None
        if b == 0 or n == 0:
            raise ValueError(f"backend='triton': empty q or k ({b} x {n})")
        q, k = q.contiguous(), k.contiguous()
        scale = scale.reshape(()).to(torch.float32).contiguous()
        cfg = self._config(q.dtype, q.device)
        dot_dtype, precision = self._dot(q.dtype, q.device)
        n_rb = triton.cdiv(b, cfg.block_m)
        n_cb = triton.cdiv(n, cfg.block_n)
        rg_target = max(1, math.isqrt(cfg.programs))
        rpg, rg = _split(n_rb, rg_target)
        cpg, cg = _split(n_cb, max(1, cfg.programs // rg))
        # Partial LSEs in base 2. row_part: every entry is written; col_part: merged into, so -inf.
        row_part = torch.empty((cg, b), dtype=torch.float32, device=q.device) if rows else scale
        col_part = torch.full((rg, n), -math.inf, dtype=torch.float32, device=q.device) if cols else scale
        lse_fwd_kernel[(rg, cg)](
            q, k, scale, row_part, col_part,
            b, n, q.shape[1], q.stride(0), k.stride(0),
            rpg, cpg,
            ROWS=rows, COLS=cols,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            DOT_DTYPE=dot_dtype, PRECISION=precision, ONE_EXP=bool(cfg.one_exp), COL_REF=bool(cfg.col_ref),
            EVEN=b % cfg.block_m == 0 and n % cfg.block_n == 0 and q.shape[1] % cfg.block_d == 0,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )
        lse_row = torch.logsumexp(row_part.mul_(_LN2), dim=0).to(ct) if rows else None
        lse_col = torch.logsumexp(col_part.mul_(_LN2), dim=0).to(ct) if cols else None
        return lse_row, lse_col

    # ------------------------------------------------------------------ backward
    @on_inputs_device
    def lse_grad(
        self, q, k, scale, lse_row, lse_col, g_row, g_col, *, pos_labels=None, g_pos=None, grad_dtype=None
    ):
        self._check(q, k, scale)
        ct = compute_dtype(q.dtype)
        grad_dtype = grad_dtype or q.dtype
        b, n, d = q.shape[0], k.shape[0], q.shape[1]
        use_rows = lse_row is not None and g_row is not None
        use_cols = lse_col is not None and g_col is not None
        use_pos = pos_labels is not None and g_pos is not None
        dq_acc = torch.zeros((b, d), dtype=torch.float32, device=q.device)
        dk = torch.empty((n, d), dtype=grad_dtype, device=k.device)
        d_scale = torch.zeros((), dtype=torch.float32, device=q.device)
        if not (use_rows or use_cols or use_pos) or b == 0 or n == 0:
            dk.zero_()
            return dq_acc.to(grad_dtype), dk, d_scale.to(ct)
        q, k = q.contiguous(), k.contiguous()
        scale = scale.reshape(()).to(torch.float32).contiguous()
        f32 = dict(dtype=torch.float32, device=q.device)
        lse_row = lse_row.to(**f32).contiguous() if use_rows else scale
        g_row = g_row.to(**f32).contiguous() if use_rows else scale
        lse_col = lse_col.to(**f32).contiguous() if use_cols else scale
        g_col = g_col.to(**f32).contiguous() if use_cols else scale
        pos_labels = pos_labels.to(device=q.device, dtype=torch.int64).contiguous() if use_pos else scale
        g_pos = g_pos.to(**f32).contiguous() if use_pos else scale

        cfg = self._config(q.dtype, q.device)
        dot_dtype, precision = self._dot(q.dtype, q.device)
        ws_dtype = torch.float32 if (q.dtype == torch.float32 or q.device.type != "cuda") else torch.bfloat16
        mm_dtype = tl.float32 if ws_dtype == torch.float32 else tl.bfloat16
        mm_precision = precision if q.dtype == torch.float32 else ("ieee" if q.device.type != "cuda" else "tf32")
        tm, tn = min(cfg.super_rows, b), min(cfg.super_cols, n)
        kmajor = bool(cfg.kmajor)
        ws = torch.empty((tm, tn), dtype=ws_dtype, device=q.device)
        # kmajor: dS.T is written too, and the right operands are read from transposed copies of
        # the current q/k chunks (O(super-tile * D) each), so both products read K-major operands.
        ws_t = torch.empty((tn, tm), dtype=ws_dtype, device=q.device) if kmajor else ws
        dk_acc = torch.empty((tn, d), dtype=torch.float32, device=q.device)

        mm_opts = dict(
            BLOCK_M=cfg.mm_block_m, BLOCK_N=cfg.mm_block_n, BLOCK_K=cfg.mm_block_k, GROUP_M=8,
            DOT_DTYPE=mm_dtype, PRECISION=mm_precision, num_warps=cfg.mm_warps, num_stages=cfg.mm_stages,
        )
        products = cfg.products
        if products == "cublas" and ws_dtype == torch.float32 and q.is_cuda:
            raise ValueError(
                "TritonTiles: products='cublas' needs float16/bfloat16 inputs on a GPU (cuBLAS fp32 GEMMs "
                "follow torch's global TF32 flag, not precision=); use 'separate' or 'pair'"
            )

        def operand(x: Tensor) -> Tensor:
            """A super-tile's q_i or k_j as the right operand of the products. kmajor: a K-major copy
            (the same (rows, D) view, rows contiguous). cuBLAS wants one operand dtype, so fp16
            features meeting the bf16 dS workspace are rounded to bf16, as the Triton products do
            in registers (a copy of rows * D elements; bf16 inputs: no copy)."""
            x = x.to(ws_dtype) if products == "cublas" else x
            return x.t().contiguous().t() if kmajor else x

        def tiles(m_: int) -> int:
            return triton.cdiv(m_, cfg.mm_block_m) * triton.cdiv(d, cfg.mm_block_n)

        def products_acc(a1: Tensor, b1: Tensor, c1: Tensor, a2: Tensor, b2: Tensor, c2: Tensor) -> None:
            """c1 += a1 @ b1 and c2 += a2 @ b2 (c fp32 with contiguous rows, N = D for both)."""
            if products == "cublas":
                mm_acc(c1, a1, b1)
                mm_acc(c2, a2, b2)
            elif products == "pair":
                matmul_acc_pair_kernel[(tiles(a1.shape[0]) + tiles(a2.shape[0]),)](
                    a1, b1, c1, a1.shape[0], a1.shape[1], a1.stride(0), a1.stride(1), b1.stride(0), b1.stride(1), c1.stride(0),
                    a2, b2, c2, a2.shape[0], a2.shape[1], a2.stride(0), a2.stride(1), b2.stride(0), b2.stride(1), c2.stride(0),
                    d, **mm_opts,
                )
            else:
                for a, bm, c in ((a1, b1, c1), (a2, b2, c2)):
                    matmul_acc_kernel[(tiles(a.shape[0]),)](
                        a, bm, c, a.shape[0], d, a.shape[1],
                        a.stride(0), a.stride(1), bm.stride(0), bm.stride(1), c.stride(0), **mm_opts,
                    )

        for j0 in range(0, n, tn):
            nj = min(tn, n - j0)
            kj = k[j0 : j0 + nj]
            kj_b = operand(kj)  # once per key super-block, reused by every row super-block
            acc_j = dk_acc[:nj].zero_()
            for i0 in range(0, b, tm):
                ni = min(tm, b - i0)
                qi = q[i0 : i0 + ni]
                ws_ij = ws[:ni, :nj]
                ws_t_ij = ws_t[:nj, :ni] if kmajor else ws_ij.t()
                grid = (triton.cdiv(ni, cfg.ds_block_m), triton.cdiv(nj, cfg.ds_block_n))
                dlogits_kernel[grid](
                    qi, kj, scale,
                    lse_row[i0:] if use_rows else scale, lse_col[j0:] if use_cols else scale,
                    g_row[i0:] if use_rows else scale, g_col[j0:] if use_cols else scale,
                    pos_labels[i0:] if use_pos else scale, g_pos[i0:] if use_pos else scale,
                    ws_ij, ws_t_ij, ni, nj, d, j0, qi.stride(0), kj.stride(0), ws_ij.stride(0),
                    ws_t_ij.stride(0) if kmajor else 0,
                    HAS_ROW=use_rows, HAS_COL=use_cols, HAS_POS=use_pos,
                    BLOCK_M=cfg.ds_block_m, BLOCK_N=cfg.ds_block_n, BLOCK_D=cfg.ds_block_d,
                    DOT_DTYPE=dot_dtype, PRECISION=precision, ONE_EXP=bool(cfg.ds_one_exp), WRITE_T=kmajor,
                    EVEN=ni % cfg.ds_block_m == 0 and nj % cfg.ds_block_n == 0 and d % cfg.ds_block_d == 0,
                    num_warps=cfg.ds_warps, num_stages=cfg.ds_stages,
                )
                qi_b = operand(qi)
                # dq_i += dS @ k_j and dk_j += dS.T @ q_i
                products_acc(ws_ij, kj_b, dq_acc[i0 : i0 + ni], ws_t_ij, qi_b, acc_j)
            # d_scale = sum_ij dS_ij (q_i . k_j) = sum_j k_j . (dS.T @ q)_j: O(nj*D), no tile pass.
            d_scale += torch.dot(kj.reshape(-1).to(torch.float32), acc_j.reshape(-1))
            dk[j0 : j0 + nj] = acc_j.mul_(scale).to(grad_dtype)
        # The workspaces (and every view of them) go before the fp32 dq is rounded, so the peak is
        # dq_acc + dq + dk: 2 * (bytes(q) + bytes(k)) for half inputs.
        del ws, ws_t, dk_acc, acc_j, ws_ij, ws_t_ij, kj_b, qi_b
        dq = dq_acc.mul_(scale).to(grad_dtype)
        return dq, dk, d_scale.to(ct)
