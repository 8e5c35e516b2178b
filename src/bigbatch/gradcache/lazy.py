"""Lazy modules (``nn.LazyLinear``, ...) in gradient caching: their initialisation's random draws.

A lazy module materialises its parameters inside its first forward, and the initialisation
draws from the random generators. Under gradient caching that first forward is a chunk's pass 1;
its re-run replays the random state captured before the chunk, but nothing is initialised again,
so every later draw of the re-run (dropout masks) would come from numbers the initialisation had
consumed in pass 1: other masks than the loss saw, a silently wrong gradient.

:class:`LazyInits` records, in pass 1, the random state right after each initialisation; the
re-run jumps to that state when its forward reaches the same module (before the module runs), so
its random stream is pass 1's with the initialisation's draws skipped: the same masks. The
weights, and the generators after the step, are those of a plain forward over the same chunks.
Costs nothing once the modules are materialised (the first step): no module is watched then.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Sequence

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from .hooks import forward_pre_hooks
from .rng import RngState
from . import walk


def _pending(m: nn.Module) -> bool:
    """Not materialised yet (once it is, a ``LazyLinear`` has become a plain ``Linear``)."""
    return isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()


def _uninitialised(models: Sequence[nn.Module]) -> List[nn.Module]:
    seen: Dict[int, nn.Module] = {}
    for model in models:
        for m in walk.submodules(model):
            if _pending(m):
                seen.setdefault(id(m), m)
    return list(seen.values())


class LazyInits:
    """The lazy modules of ``models`` not yet materialised, watched through one pass-1 forward."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.modules = _uninitialised(models)

    @contextlib.contextmanager
    def recording(self, devices: Sequence[int]) -> Iterator[Dict[int, RngState]]:
        """Around one pass-1 forward: yields ``{id(module): random state right after its
        initialisation}``, filled for the modules that initialised in the body (each at most once)."""
        after: Dict[int, RngState] = {}
        if not self.modules:
            yield after
            return
        pending: Dict[int, bool] = {}

        def before(module, args):
            pending[id(module)] = _pending(module)

        def done(module, args):  # runs after LazyModuleMixin's own pre-hook, which initialised it
            if pending.pop(id(module), False) and not _pending(module) and id(module) not in after:
                after[id(module)] = RngState(devices)

        try:
            with forward_pre_hooks([(m, before, True) for m in self.modules] + [(m, done, False) for m in self.modules]):
                yield after
        finally:
            self.modules = [m for m in self.modules if _pending(m)]


@contextlib.contextmanager
def skipping_inits(models: Sequence[nn.Module], after: Dict[int, RngState]) -> Iterator[None]:
    """Around a re-run (inside its random-state replay): where pass 1 initialised a module, set
    the generators to the state pass 1 had right after that initialisation, once per module."""
    if not after:
        yield
        return
    todo = dict(after)

    def jump(module, args):
        state = todo.pop(id(module), None)
        if state is not None:
            state.restore()

    modules = {id(m): m for model in models for m in walk.submodules(model) if id(m) in todo}
    with forward_pre_hooks([(m, jump, True) for m in modules.values()]):
        yield


@contextlib.contextmanager
def buffers_reset_after(models: Sequence[nn.Module]) -> Iterator[None]:
    """Around forwards that must leave no trace (the memory probe): a lazy module that materialises
    in the body gets its buffers (``LazyBatchNorm``'s running statistics) put back, on exit, to
    their values right after initialisation, before any forward updated them. (Buffers that were
    already materialised are the caller's to restore: ``buffers.buffers_restored``.)"""
    modules = _uninitialised(models)
    if not modules:
        yield
        return
    fresh: Dict[int, Dict[str, object]] = {}

    def snapshot(module, args):  # after LazyModuleMixin's own pre-hook: initialised, not yet run
        if id(module) not in fresh and not _pending(module):
            fresh[id(module)] = {n: b.detach().clone() for n, b in module.named_buffers(recurse=False)
                                 if b is not None}

    try:
        with forward_pre_hooks([(m, snapshot, False) for m in modules]):
            yield
    finally:
        for m in modules:
            for name, value in fresh.get(id(m), {}).items():
                buf = getattr(m, name, None)
                if buf is not None and buf.shape == value.shape:
                    with torch.no_grad():
                        buf.copy_(value)
