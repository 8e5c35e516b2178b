"""Hooks that live for one block: forward pre-hooks registered on entry and removed on exit (also on
error); leaf tensors' gradient hooks and ``.grad`` set aside for a block."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Tuple

from torch import Tensor, nn


@contextlib.contextmanager
def forward_pre_hooks(hooks: Iterable[Tuple[nn.Module, Callable[[nn.Module, Any], Any], bool]]) -> Iterator[None]:
    """Register each ``(module, hook, prepend)`` for the body (``prepend``: before the module's
    other pre-hooks, e.g. before a lazy module's own initialisation hook)."""
    handles = []
    try:
        for module, hook, prepend in hooks:
            handles.append(module.register_forward_pre_hook(hook, prepend=prepend))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def leaf_grads_set_aside(leaves: Iterable[Tensor]) -> Iterator[None]:
    """For the body, each leaf tensor's ``.grad`` is ``None`` and its tensor hooks
    (``register_hook``) and post-accumulate-grad hooks are unregistered; on exit ``.grad`` and the
    hooks are put back, whatever the body accumulated into ``.grad`` dropped. For a backward
    nobody may see (the memory probe's made-up gradients), not a gradient logger nor ``.grad``.

    The hooks live in each tensor's ``_backward_hooks`` / ``_post_accumulate_grad_hooks`` dicts,
    which autograd reads when it runs them: emptied for the body, refilled after (handles the user
    holds stay valid)."""
    saved = []
    try:
        for t in {id(t): t for t in leaves}.values():
            hooks = [(name, dict(d)) for name in ("_backward_hooks", "_post_accumulate_grad_hooks")
                     for d in [getattr(t, name, None)] if isinstance(d, dict) and d]
            saved.append((t, t.grad, hooks))
            t.grad = None
            for name, _ in hooks:
                getattr(t, name).clear()
    except BaseException:
        _put_back(saved)
        raise
    try:
        yield
    finally:
        _put_back(saved)


def _put_back(saved: list) -> None:
    for t, grad, hooks in saved:
        t.grad = grad
        for name, entries in hooks:
            getattr(t, name).update(entries)
