"""``acc += a @ b`` with an fp32 accumulator for half-precision operands, on cuBLAS.

Shared by the tile backends whose gradient products run as GEMMs over a workspace tile
(``triton_sigmoid``, ``triton_softmax``). Half operands with an fp32 output are one fused
GEMM where torch has ``addmm(..., out_dtype=)`` (checked once against an fp64 product before it
is trusted), else a fp32-output GEMM plus an add, else up-cast operands (CPU).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Dict, Iterator, Optional

import torch
from torch import Tensor


# How ``acc += a @ b`` is done for half-precision a, b and an fp32 accumulator, per device type
# (decided on first use there: a CPU call first must not decide it for CUDA, nor the reverse)
_MM_ACC_MODES: Dict[str, str] = {}


def _mm_acc_mode(device: torch.device) -> str:
    """``"addmm_out_dtype"`` (fused fp32-output GEMM), ``"mm_out_dtype"`` (GEMM + add) or ``"upcast"``.

    The fused form is checked once against an fp64 product before it is trusted.
    """
    if device.type in _MM_ACC_MODES:
        return _MM_ACC_MODES[device.type]
    if device.type != "cuda":
        _MM_ACC_MODES[device.type] = "upcast"
        return "upcast"
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(64, 96, device=device, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, 48, device=device, generator=gen).to(torch.bfloat16)
    acc0 = torch.randn(64, 48, device=device, generator=gen)
    want = acc0.double() + 0.5 * (a.double() @ b.double())  # with an alpha, as mm_acc may pass one
    mode = "upcast"
    try:
        acc = acc0.clone()
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc, alpha=0.5)
        if (acc.double() - want).abs().max().item() < 1e-3:
            mode = "addmm_out_dtype"
    except (RuntimeError, TypeError, NotImplementedError):
        pass
    if mode == "upcast":
        try:
            acc = acc0 + 0.5 * torch.mm(a, b, out_dtype=torch.float32)
            if (acc.double() - want).abs().max().item() < 1e-3:
                mode = "mm_out_dtype"
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    _MM_ACC_MODES[device.type] = mode
    return mode


def mm_acc(acc: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> None:
    """``acc += alpha * (a @ b)`` with fp32 (or fp64) accumulation whatever the dtype of a and b
    (``alpha`` a power of two undoes a scaling of ``a`` exactly)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, alpha=alpha)
        return
    mode = _mm_acc_mode(acc.device)
    if mode == "addmm_out_dtype":
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc, alpha=alpha)
    elif mode == "mm_out_dtype":
        acc.add_(torch.mm(a, b, out_dtype=acc.dtype), alpha=alpha)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), alpha=alpha)


FP32_PRECISIONS = ("tf32", "ieee")


def torch_allows_tf32() -> bool:
    """Whether torch's CUDA float32 matmuls may use TF32 now: ``torch.backends.cuda.matmul.fp32_precision``
    (torch >= 2.9; it reads the value inherited from ``torch.backends.fp32_precision``) or the
    legacy ``allow_tf32`` (also set by ``torch.set_float32_matmul_precision("high"/"medium")``).
    torch's default is no (full fp32)."""
    mm = torch.backends.cuda.matmul
    for value in (getattr(mm, "fp32_precision", None), getattr(torch.backends, "fp32_precision", None)):
        if value in ("tf32", "ieee"):
            return value == "tf32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.9 warns once on the legacy read ("use the new API")
        try:
            return bool(mm.allow_tf32)
        except RuntimeError:  # torch refuses the legacy read after a mix of its two APIs
            return False


def fp32_dot_precision(requested: Optional[str]) -> str:
    """The fused kernels' float32 dot precision: ``requested`` (``"tf32"`` or ``"ieee"``), or with
    ``None`` what a float32 ``torch.mm`` on CUDA would use now (``"ieee"`` by torch's default),
    read at each call like torch does."""
    if requested is not None:
        return requested
    return "tf32" if torch_allows_tf32() else "ieee"


def check_fp32_precision(owner: str, arg: str, value: object) -> None:
    if value is not None and value not in FP32_PRECISIONS:
        raise ValueError(f"{owner}: {arg} must be one of {FP32_PRECISIONS} or None (follow torch's CUDA matmul "
                         f"setting), got {value!r}")


_PRECISION_LOCK = threading.RLock()


@contextlib.contextmanager
def fp32_matmul(precision: Optional[str]) -> Iterator[None]:
    """cuBLAS fp32 GEMMs at ``precision`` for the block: ``"ieee"`` full fp32, ``"tf32"`` TF32 (they
    otherwise follow the caller's global setting); ``None`` leaves it. Sets and restores the CUDA
    matmul's own setting (``torch.backends.cuda.matmul.fp32_precision`` where torch has it, else
    ``allow_tf32``), which mixes with either of torch's APIs; a lock keeps two threads' blocks from
    restoring each other's values (other threads' fp32 GEMMs inside the block see it too)."""
    if precision is None:
        yield
        return
    mm = torch.backends.cuda.matmul
    new_api = hasattr(mm, "fp32_precision")
    with _PRECISION_LOCK:
        if torch_allows_tf32() == (precision == "tf32"):
            # already in force: touch nothing (a restore would pin a value the CUDA matmul inherits
            # from torch.backends.fp32_precision as its own, so that it no longer followed the global)
            yield
            return
        old = mm.fp32_precision if new_api else mm.allow_tf32
        if new_api and old == getattr(torch.backends, "fp32_precision", None):
            # reading gives the value it inherits from torch.backends.fp32_precision: restoring that
            # value would pin it ("none" inherits again; one set equal to the global reads the same)
            old = "none"
        if new_api:
            mm.fp32_precision = precision
        else:
            mm.allow_tf32 = precision == "tf32"
        try:
            yield
        finally:
            if new_api:
                mm.fp32_precision = old
            else:
                mm.allow_tf32 = old
