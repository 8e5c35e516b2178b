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
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable

F = TypeVar("F", bound=Callable[..., Any])

# torch's queries, looked up once (some run per LayerNorm call; absent on older torch versions)
_FUNCTORCH = getattr(torch._C, "_functorch", None)
_WRAPPED = getattr(_FUNCTORCH, "is_functorch_wrapped_tensor", None)
_BATCHED = tuple(c for c in (getattr(_FUNCTORCH, n, None) for n in ("is_legacy_batchedtensor", "is_batchedtensor"))
                 if c is not None)
_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)
_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)

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


def distinct(*args: Any) -> list:
    """``args`` with every tensor that repeats an earlier one (the same object: ``clip_loss(x, x)``)
    replaced by a view of it. ``torch.compile`` refuses an autograd Function that is given one
    tensor twice ("duplicate tensor input", a graph break that fails ``fullgraph=True``); autograd
    sums the gradients of a view and its base either way, so eager results are unchanged."""
    out: list = []
    for a in args:  # identity by ``is`` (torch 2.11's dynamo cannot take id() of an intermediate tensor)
        if isinstance(a, torch.Tensor) and any(a is b for b in out):
            a = a.view_as(a)
        out.append(a)
    return out


def transformed(*tensors: Any) -> bool:
    """Whether a tensor carries a forward-mode AD tangent or is wrapped by a ``torch.func``
    transform (vmap, grad, jvp). Such an input has ``requires_grad=False``, yet a loss-only fast
    path that skips the autograd Function would drop its tangent or fail deep inside a kernel:
    it must go through the Function, which refuses it with torch's own clear error."""
    if _compiling():  # dynamo cannot trace the functorch query; a compiled graph sees plain tensors
        return False
    # tangents exist only inside a dual_level context (cheap to ask: this runs per LayerNorm call)
    duals = getattr(forward_ad, "_current_level", 0) >= 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if _WRAPPED is not None and _WRAPPED(t):
            return True
        if duals and forward_ad.unpack_dual(t).tangent is not None:
            return True
    return False


def refuse_transformed(what: str, *tensors: Any) -> None:
    """Raise for forward-mode AD / ``torch.func`` inputs before any collective: in a ring, one
    rank refusing them inside the autograd Function would leave the others waiting."""
    if transformed(*tensors):
        raise NotImplementedError(
            f"{what} support neither forward-mode AD (dual tensors) nor torch.func transforms (vmap, grad, "
            "jvp): use backend='reference' on one process for those")


def _compiling() -> bool:
    return bool(_IS_COMPILING()) if _IS_COMPILING is not None else False


def batched(*tensors: Any) -> bool:
    """Whether a tensor is batched by vmap: the legacy batching of ``autograd.grad(...,
    is_grads_batched=True)`` or ``torch.func.vmap``'s."""
    return any(isinstance(t, torch.Tensor) and c(t) for t in tensors for c in _BATCHED)


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp) is running now, whatever its inputs:
    an autograd Function without ``setup_context`` is refused inside one."""
    return bool(_TRANSFORMS_ACTIVE()) if _TRANSFORMS_ACTIVE is not None else False


def refuse_batched(what: str, instead: str, grads: Any) -> None:
    """Raise if the backward runs on batched gradients (``autograd.grad(..., is_grads_batched=True)``,
    which vmaps the backward): tiles accumulated in place cannot carry a batch of gradients, and
    the failure deep inside would name an internal op. (``torch.func`` transforms stop earlier, at
    torch's own error for Functions without ``setup_context``.) Skipped while dynamo traces the
    backward (``torch.compile``): it cannot trace the functorch queries, and a compiled backward
    is never a batched one."""
    if _compiling():
        return
    if batched(*grads):
        raise RuntimeError(
            f"{what} do not support batched gradients (autograd.grad(..., is_grads_batched=True), "
            f"vmap): back-propagate each gradient in turn; {instead}")


def first_order(backward: F) -> F:
    """Decorate an autograd Function's ``backward``: ``once_differentiable``, and clear errors
    under ``create_graph=True`` and for batched gradients (vmap)."""
    inner = once_differentiable(backward)

    @functools.wraps(backward)
    def wrapped(ctx: Any, *grads: Any) -> Any:
        refuse_create_graph(*_LOSSES)
        refuse_batched(_LOSSES[0], "or use backend='reference' on one process", grads)
        return inner(ctx, *grads)

    return wrapped  # type: ignore[return-value]
