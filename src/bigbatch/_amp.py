"""The losses compute in their inputs' dtypes with fp32 accumulation, whatever autocast region
they are called in (OpenCLIP computes its loss inside the training step's autocast): autocast
would run the logits tiles' matmuls in half precision in the forward but not in a backward run
outside the region, and the saved statistics would not match the recomputed tiles."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def _off(device_type: str) -> Any:
    """Autocast off for ``device_type`` if it is on now, else nothing (no warning on a CUDA-less build)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_off(fn: F) -> F:
    """Decorate a loss entry point or an autograd Function's backward: it runs without autocast.
    Plain nested ``with`` blocks, which ``torch.compile`` traces without a graph break."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _off("cuda"), _off("cpu"):
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]
