"""Backend registry: names -> backend objects, and the ``"auto"`` choice.

``backend=`` in the public API accepts one of :data:`BACKEND_NAMES` or a backend
object (e.g. ``TorchTiles(tile_rows=256, tile_cols=512)``) to override its settings.
``"reference"`` is not a tile backend: :func:`resolve_backend` returns the string
and the functional layer runs the full-matrix implementation.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Dict, Optional, Union

import torch

from .base import SigmoidBackend, TileBackend, compute_dtype
from .torch_sigmoid import TorchSigmoid
from .torch_tiles import TorchTiles

BACKEND_NAMES = ("auto", "reference", "torch", "triton")

BackendArg = Union[str, TileBackend]


# looked up once, at import: torch.compile (2.11) refuses importlib.util.find_spec inside a graph
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether the triton package can be imported (it may still lack a GPU)."""
    return _TRITON_FOUND


def triton_interpreted() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter now (read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes", "y")


# @triton.jit decides at decoration (the kernel module's import) whether a kernel is interpreted:
# setting TRITON_INTERPRET later does not reach it. Kernel module -> whether its kernels are.
_KERNELS_INTERPRETED: Dict[str, bool] = {}
_OP_KERNELS = {"softmax": ("bigbatch.backends.triton_softmax_fwd", "bigbatch.backends.triton_softmax_bwd"),
               "sigmoid": ("bigbatch.backends.triton_sigmoid",)}


def kernels_imported(module: str, kernel: object) -> None:
    """Called by each module that defines Triton kernels, at its import, with one of them."""
    _KERNELS_INTERPRETED[module] = type(kernel).__name__ == "InterpretedFunction"


def _interpreted(op: str) -> bool:
    """Whether ``op``'s kernels run interpreted: TRITON_INTERPRET asks for it now, and they were
    imported under it (or are not imported yet).
    Triton's own library functions (``tl.cdiv``, ``tl.max``) are decorated when triton is imported:
    imported without the interpreter, interpreted kernels calling them fail ("Cannot call
    @triton.jit'd outside of the scope of a kernel")."""
    if not triton_interpreted():
        return False
    library = getattr(sys.modules.get("triton.language.standard"), "cdiv", None)
    if library is not None and type(library).__name__ != "InterpretedFunction":
        return False
    return all(_KERNELS_INTERPRETED.get(m, True) for m in _OP_KERNELS[op])


def _triton_refusal(device: torch.device, op: str) -> str:
    """What the Triton backend needs, for a device it cannot run on (and why a CPU device is refused
    although TRITON_INTERPRET asks for the interpreter now)."""
    why = f"needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got tensors on {device}"
    if device.type == "cpu" and triton_interpreted() and not _interpreted(op):  # (imported without it)
        why += ("; TRITON_INTERPRET was set after triton was imported (Triton fixes it at import): set it "
                "before anything imports triton")
    return why


def triton_runs_on(device: torch.device, op: str = "softmax") -> bool:
    """Whether ``op``'s Triton backend ("softmax" or "sigmoid") can run on ``device``: CUDA, or the
    CPU when its kernels are (or, not imported yet, will be) interpreted."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and _interpreted(op)


# Per op: (protocol, what a backend object must be, torch class).
_OPS = {
    "softmax": (TileBackend, "a softmax backend object (TorchTiles, TritonTiles)", TorchTiles),
    "sigmoid": (SigmoidBackend, "a sigmoid backend object (TorchSigmoid, TritonSigmoid)", TorchSigmoid),
}


def _make_triton(op: str):
    if not triton_available():
        raise ValueError(
            "backend='triton' needs the triton package; install it with `pip install triton` "
            "(or `pip install bigbatch[triton]`)"
        )
    return _triton_class(op)()


def _triton_class(op: str):
    """``op``'s Triton backend class, imported here (triton is optional): with import statements,
    which torch.compile traces (fullgraph=True with backend "auto" / "triton"), where it refuses
    importlib.import_module."""
    if op == "softmax":
        from .triton_softmax import TritonTiles

        return TritonTiles
    from .triton_sigmoid import TritonSigmoid

    return TritonSigmoid


def resolve_backend(
    backend: BackendArg, device: torch.device, dtype: Optional[torch.dtype] = None, *, op: str = "softmax"
):
    """Turn the ``backend`` argument into ``"reference"`` or a backend of ``op`` ("softmax": a
    :class:`TileBackend`, "sigmoid": a :class:`SigmoidBackend`) usable on ``device`` for features of
    ``dtype`` when given (the fused kernels take half and single precision: ``"auto"`` keeps float64
    on the torch tiles, ``"triton"`` refuses it)."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {tuple(_OPS)}, got {op!r}")
    protocol, what, torch_cls = _OPS[op]
    if isinstance(backend, type):  # the class passes the Protocol check; its methods are unbound
        raise TypeError(f"backend must be one of {BACKEND_NAMES} or {what}, got the class "
                        f"{backend.__name__}: pass an instance, e.g. backend={backend.__name__}()")
    if not isinstance(backend, str):
        if isinstance(backend, protocol):
            if not backend.supports(device):
                why = _triton_refusal(device, op) if backend.name == "triton" else f"cannot run on device {device}"
                raise ValueError(f"backend {backend.name!r} {why}")
            return backend
        raise TypeError(f"backend must be one of {BACKEND_NAMES} or {what}, got {type(backend).__name__}")
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    if backend == "reference":
        return "reference"
    if backend == "torch":
        return torch_cls()
    if backend == "triton":
        # checked before the kernel module is imported: Triton fixes at @triton.jit time whether a
        # kernel is interpreted, so importing it under the wrong setting would stick for the process
        if not triton_runs_on(device, op):
            raise ValueError(f"backend='triton' {_triton_refusal(device, op)}")
        if dtype == torch.float64:
            raise ValueError("backend='triton' takes float16/bfloat16/float32 features, got float64; use backend='torch'")
        return _make_triton(op)
    if device.type == "cuda" and triton_available() and dtype != torch.float64:
        return _make_triton(op)
    return torch_cls()


__all__ = [
    "BACKEND_NAMES",
    "BackendArg",
    "SigmoidBackend",
    "TileBackend",
    "TorchSigmoid",
    "TorchTiles",
    "compute_dtype",
    "resolve_backend",
    "triton_available",
    "triton_interpreted",
    "triton_runs_on",
]


def __getattr__(name: str):
    """``TritonTiles`` / ``TritonSigmoid`` from here, imported when first asked for: the kernel
    modules need triton, and importing them fixes whether their kernels are interpreted."""
    op = {"TritonTiles": "softmax", "TritonSigmoid": "sigmoid"}.get(name)
    if op is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not triton_available():
        raise ImportError(f"{name} needs the triton package: pip install triton (or pip install bigbatch[triton])")
    return _triton_class(op)


def __dir__():
    return sorted(list(globals()) + ["TritonSigmoid", "TritonTiles"])
