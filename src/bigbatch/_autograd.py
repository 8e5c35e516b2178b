"""First-order-only backwards, refused loudly under ``create_graph=True``.

The tiled losses' and the ring's backwards recompute tiles without a graph, and ``cached_encode``'s
re-runs accumulate into ``.grad``: their gradients are constants. ``once_differentiable`` alone
raises only when an *incoming* gradient requires grad; for a scalar loss it does not, so a
``create_graph=True`` backward (a gradient penalty, ``torch.autograd.functional.hessian``) would
silently miss every second-order term through these nodes. Autograd runs a backward in grad mode
exactly when ``create_graph=True``, which is what is checked here.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch
from torch.autograd.function import once_differentiable

F = TypeVar("F", bound=Callable[..., Any])

_LOSSES = ("the tiled losses (backends 'torch' and 'triton', and the ring over a process group)",
           "for second derivatives of a loss use backend='reference' on one process")


def refuse_create_graph(what: str, instead: str) -> None:
    """Raise if the backward running now was asked for a graph of its gradients."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} give first-order gradients only, but this backward runs with create_graph=True "
            "(a double backward: a gradient penalty, torch.autograd.functional.hessian, ...), whose "
            f"second-order terms through it would be missing; {instead}"
        )


def first_order(backward: F) -> F:
    """Decorate an autograd Function's ``backward``: ``once_differentiable``, and a clear error
    under ``create_graph=True``."""
    inner = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapped(ctx: Any, *grads: Any) -> Any:
        refuse_create_graph(*_LOSSES)
        return inner(ctx, *grads)

    return wrapped  # type: ignore[return-value]
