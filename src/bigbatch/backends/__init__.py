"""Backend registry: names -> backend objects, and the ``"auto"`` choice.

``backend=`` in the public API accepts one of :data:`BACKEND_NAMES` or a backend
object (e.g. ``TorchTiles(tile_rows=256, tile_cols=512)``) to override its settings.
``"reference"`` is not a tile backend: :func:`resolve_backend` returns the string
and the functional layer runs the full-matrix implementation.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional, Union

import torch

from .base import TileBackend, compute_dtype
from .torch_tiles import TorchTiles

BACKEND_NAMES = ("auto", "reference", "torch", "triton")

BackendArg = Union[str, TileBackend]


def triton_available() -> bool:
    """Whether the triton package can be imported (it may still lack a GPU)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _make_triton():
    if not triton_available():
        raise ValueError(
            "backend='triton' needs the triton package; install it with `pip install triton` "
            "(or `pip install bigbatch[triton]`)"
        )
    from .triton_softmax import TritonTiles  # imported lazily: triton is optional

    return TritonTiles()


def resolve_backend(
    backend: BackendArg, device: torch.device, dtype: Optional[torch.dtype] = None
) -> Union[str, TileBackend]:
    """Turn the ``backend`` argument into ``"reference"`` or a tile backend usable on ``device``
    (and, when given, for features of ``dtype``: ``"auto"`` keeps float64 on the torch tiles)."""
    if not isinstance(backend, str):
        if isinstance(backend, TileBackend):
            if not backend.supports(device):
                raise ValueError(f"backend {backend.name!r} cannot run on device {device}")
            return backend
        raise TypeError(
            f"backend must be one of {BACKEND_NAMES} or a backend object, got {type(backend).__name__}"
        )
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if backend == "torch":
        return TorchTiles()
    if backend == "triton":
        impl = _make_triton()
        if not impl.supports(device):
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
                f"got tensors on {device}"
            )
        return impl
    # auto: the fused kernels on a GPU when triton is there (they take half and single
    # precision), the torch tiles otherwise.
    if device.type == "cuda" and triton_available() and dtype != torch.float64:
        return _make_triton()
    return TorchTiles()


__all__ = [
    "BACKEND_NAMES",
    "BackendArg",
    "TileBackend",
    "TorchTiles",
    "compute_dtype",
    "resolve_backend",
    "triton_available",
    "triton_interpreted",
]
