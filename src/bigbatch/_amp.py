"""The losses compute in their inputs' dtypes with fp32 accumulation, whatever autocast region
they are called in (OpenCLIP computes its loss inside the training step's autocast): autocast
would run the logits tiles' matmuls in half precision in the forward but not in a backward run
outside the region, and the saved statistics would not match the recomputed tiles."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def autocast_disabled() -> Iterator[None]:
    """Autocast off for every device type on which it is on now (nothing entered otherwise)."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cuda", "cpu"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield


def autocast_off(fn: F) -> F:
    """Decorate a loss entry point or an autograd Function's backward: it runs without autocast."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with autocast_disabled():
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]
