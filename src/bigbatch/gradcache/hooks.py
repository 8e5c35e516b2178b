"""Forward pre-hooks that live for one block: registered on entry, removed on exit (also on error)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Tuple

from torch import nn


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
