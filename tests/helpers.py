"""Assertions and data makers shared by the tests."""

from __future__ import annotations

import torch
from torch import Tensor

# Where backend="triton" runs in the tests: a CUDA device when there is one (the real kernels),
# otherwise the CPU under Triton's interpreter (conftest sets TRITON_INTERPRET=1 there).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(x: Tensor, ref: Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (absolute error when ref is all zeros). NaN stays NaN."""
    x64, r64 = x.detach().double().cpu(), ref.detach().double().cpu()
    den = r64.norm().item()
    num = (x64 - r64).norm().item()
    return num / den if den > 0 else num


def assert_rel(x: Tensor, ref: Tensor, tol: float, what: str = "value") -> None:
    assert x.shape == ref.shape, f"{what}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{what}: non-finite entries"
    err = rel_err(x, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def assert_close(x: Tensor, ref: Tensor, tol: float, floor: float, what: str = "value") -> None:
    """``||x - ref|| <= tol * ||ref|| + floor``: relative, with an absolute floor for results that
    cancel far below the size of their terms (fp32 rounding is relative to the terms, not the sum)."""
    assert x.shape == ref.shape, f"{what}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{what}: non-finite entries"
    err = (x.detach().double().cpu() - ref.detach().double().cpu()).norm().item()
    bound = tol * ref.detach().double().norm().item() + floor
    assert err <= bound, f"{what}: error {err:.3e} > {tol:.1e} * |ref| + {floor:.1e} = {bound:.3e}"


def features(b: int, d: int, *, dtype=torch.float32, device="cpu", seed: int = 0, normalize: bool = True) -> Tensor:
    """Random (b, d) features (unit rows when ``normalize``), leaf tensor requiring grad."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=torch.float64)
    if normalize:
        x = x / x.norm(dim=1, keepdim=True)
    return x.to(device=device, dtype=dtype).requires_grad_(True)


class CudaDeviceRecorder:
    """Stands in for ``torch.cuda.device`` on a machine without CUDA (monkeypatch it in):
    ``entered`` lists every device made current, ``current`` those current now (a stack)."""

    def __init__(self) -> None:
        self.entered: list = []
        self.current: list = []

    def __call__(self, device):
        recorder = self

        class Current:
            def __enter__(self):
                recorder.entered.append(device)
                recorder.current.append(device)

            def __exit__(self, *exc):
                recorder.current.pop()
                return False

        return Current()
