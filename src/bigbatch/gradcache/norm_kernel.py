"""Triton kernel: LayerNorm's backward in one pass, weight and bias gradients included.

PyTorch computes LayerNorm's weight / bias gradients with a kernel (``GammaBetaBackward``) that
switches to a split-row reduction only above 64 x 1024 rows; on the ~32k-token chunks that
gradient caching runs at a 16 GiB budget it runs at about a third of memory bandwidth (docs/gradcache.md,
"Where the rest goes"). This kernel reads each row of ``x`` and ``dy`` once and writes ``dx``, while
each program sums ``dy * x_hat`` and ``dy`` over its own block of rows into one fp32 row of a
``(programs, N)`` partial buffer; :func:`layer_norm_backward` sums those rows (deterministic: no
atomics). Bytes: read ``x`` and ``dy``, write ``dx`` -- the minimum for this op.

Mean and 1/std are recomputed from ``x`` (it is in registers anyway) instead of saved by the
forward, in fp32 whatever the input dtype; they differ from the forward's in the last bits only.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def layer_norm_bwd_kernel(
    x_ptr, dy_ptr, w_ptr, dx_ptr, pdw_ptr, pdb_ptr,
    M, N, inv_n, rows_per_prog, eps, stride_x, stride_dy,
    HAS_W: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Rows ``[pid * rows_per_prog, (pid + 1) * rows_per_prog)`` of ``x`` / ``dy`` (``M x N``, unit
    column stride): ``dx`` of each (contiguous), and this program's sums of ``dy * x_hat`` (``pdw[pid]``) and of
    ``dy`` (``pdb[pid]``). ``rows_per_prog`` is a multiple of ``BLOCK_M``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_prog
    for i in range(0, rows_per_prog, BLOCK_M):
        rows = first + i + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) * inv_n  # (times 1/N, as PyTorch's kernels: one rounding less than / N)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) * inv_n
        rstd = 1.0 / tl.sqrt(var + eps)
        xhat = xc * rstd[:, None]
        if NEED_DX:
            if HAS_W:
                wdy = dy * w[None, :]
            else:
                wdy = dy
            c1 = tl.sum(xhat * wdy, axis=1) * inv_n
            c2 = tl.sum(wdy, axis=1) * inv_n
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            tl.store(dx_ptr + rows64[:, None] * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            acc_dw += tl.sum(dy * xhat, axis=0)
        if NEED_DB:
            acc_db += tl.sum(dy, axis=0)
    if NEED_DW:
        tl.store(pdw_ptr + pid * N + cols, acc_dw, mask=cmask)
    if NEED_DB:
        tl.store(pdb_ptr + pid * N + cols, acc_db, mask=cmask)


@functools.lru_cache(maxsize=256)
def _launch_plan(m: int, n: int, elem_bytes: int, sms: int, block_m: Optional[int] = None,
                 per_sm: Optional[int] = None) -> Tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_M, num_warps, programs, rows per program) for ``m x n`` rows of ``elem_bytes``
    each: tiles of about 16 KiB of each operand (4k fp32 or 8k half values); at most 8 programs
    per SM for fp32 rows, 2 for half rows, each over a run of whole tiles. (The fastest of 12
    configurations on an H200 at 16k-64k rows of 768: experiments/gradcache_norm_probe.py, which
    passes ``block_m`` / ``per_sm`` to sweep them.)"""
    block_n = triton.next_power_of_2(n)
    block_m = block_m or max(1, min(16, (16384 // elem_bytes) // block_n))
    warps = 4 if block_n <= 4096 else 8
    programs = max(1, min((per_sm or (8 if elem_bytes >= 4 else 2)) * sms, triton.cdiv(m, block_m)))
    rows_per_prog = triton.cdiv(triton.cdiv(m, programs), block_m) * block_m
    return block_n, block_m, warps, triton.cdiv(m, rows_per_prog), rows_per_prog


@functools.lru_cache(maxsize=16)
def _sms(device: int) -> int:
    """Multiprocessors of CUDA device ``device`` (an index; -1: the CPU, under Triton's interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device >= 0 else 1


# Compiled kernels by specialisation (below); launched through their own runner, not through
# ``kernel[grid](...)``, whose argument binding and cache lookup cost tens of microseconds of host
# time per call -- and a BERT-base chunk's backward calls this 25 times. (Set to False to launch
# through Triton's JIT every time: experiments/gradcache_norm_host_probe.py compares the two.)
# NVIDIA only: Triton's AMD backend also specialises a tensor on lying within 2 GB (buffer ops).
DIRECT = torch.version.hip is None
_COMPILED: Dict[tuple, Any] = {}


def specialisation(args: Sequence[Any]) -> tuple:
    """What Triton specialises a compiled kernel on, for each argument, or finer: a tensor's dtype
    and device and whether its address is 16-byte aligned; an int's being 1, its divisibility by 16
    and its width (i32 / i64 / u64); a float's type only. Two calls with equal keys can share one
    compiled kernel. (Triton's rules -- ``native_specialize_impl`` with the NVIDIA backend's
    ``get_tensor_specialization`` / ``get_int_specialization``, Triton 3.6-3.9 -- are these.)"""
    key = []
    for a in args:
        if isinstance(a, Tensor):
            key.append((a.dtype, a.get_device(), a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append(type(a))
        else:
            key.append((a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63))
    return tuple(key)


def launch(programs: int, args: tuple, consts: Dict[str, Any], warps: int) -> None:
    """``layer_norm_bwd_kernel`` on ``programs`` programs: ``args`` its run-time arguments, ``consts``
    its constexprs by name, in the kernel's order. The first call of a specialisation goes through Triton's JIT (which
    compiles); later ones through the compiled kernel's runner, which takes every parameter in
    order. (Under Triton's interpreter there is no compiled kernel: every call is the JIT's.) What
    Triton's JIT reads at every call -- its debug / instrumentation knobs, pre-run hooks -- is read
    here at each specialisation's first call only: set such knobs before the first backward."""
    # (the current device too: a compiled kernel is loaded onto the device current at its first launch)
    values = tuple(consts.values())
    key = (specialisation(args), values, warps, torch.cuda.current_device() if args[0].is_cuda else -1) if DIRECT else None
    compiled = _COMPILED.get(key)  # (None when not DIRECT: nothing is stored under None)
    if compiled is not None:
        compiled[(programs, 1, 1)](*args, *values)
        return
    compiled = layer_norm_bwd_kernel[(programs,)](*args, **consts, num_warps=warps)
    compiled = compiled.result() if hasattr(compiled, "result") else compiled  # (a Triton compiling asynchronously)
    if DIRECT and hasattr(compiled, "run") and hasattr(compiled, "function"):
        _COMPILED[key] = compiled


def layer_norm_backward(
    x: Tensor, dy: Tensor, weight: Optional[Tensor], eps: float, need_dx: bool, need_dw: bool, need_db: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """Gradients of ``layer_norm(x, weight, bias, eps)`` over the last dimension of the 2-D ``x`` and
    ``dy`` (``M x N``, N <= ``norms.MAX_N``: a row lives in registers, BLOCK_N fp32 values per row of the tile): ``dx`` in ``x``'s dtype, ``dw`` / ``db`` (``(N,)``, fp32); each ``None``
    unless asked for. Launches: the kernel, and one sum of the partial rows when ``dw`` or ``db`` is asked."""
    m, n = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if weight is not None and weight.stride(-1) != 1:  # (a Parameter made from a strided view)
        weight = weight.contiguous()
    dx = torch.empty((m, n), device=x.device, dtype=x.dtype) if need_dx else None
    if m == 0:
        zeros = torch.zeros(n, device=x.device, dtype=torch.float32)
        return dx, (zeros if need_dw else None), (zeros.clone() if need_db else None)
    block_n, block_m, warps, programs, rows_per_prog = _launch_plan(m, n, x.element_size(), _sms(x.get_device()))
    part = torch.empty((2, programs, n), device=x.device, dtype=torch.float32) if need_dw or need_db else x
    launch(programs, (x, dy, x if weight is None else weight, x if dx is None else dx, part,
                      part[1] if need_dw or need_db else x, m, n, 1.0 / n, rows_per_prog, eps, x.stride(0), dy.stride(0)),
           dict(HAS_W=weight is not None, NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db, BLOCK_M=block_m,
                BLOCK_N=block_n), warps)
    if not (need_dw or need_db):
        return dx, None, None
    dw, db = part.sum(1).unbind(0)
    return dx, (dw if need_dw else None), (db if need_db else None)
