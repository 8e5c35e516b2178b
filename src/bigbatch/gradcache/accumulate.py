"""A chunk's parameter gradients added into ``.grad`` in a few multi-tensor launches.

In every re-run chunk's backward, autograd's ``AccumulateGrad`` adds each parameter's new
gradient into its existing ``.grad`` with one kernel per parameter (about 200 for a BERT-base
encoder), while a parameter whose ``.grad`` is ``None`` simply adopts the new gradient (no
kernel). :class:`GradAccumulation` uses that: it sets the model's ``.grad`` tensors aside, lets each
chunk's backward adopt fresh gradients, adds them into the set-aside tensors with
``torch._foreach_add_`` (a handful of launches), and puts them back after the model's last
chunk. Each element gets the same one rounding as ``old += new``; layouts, tensor identity and
views of ``.grad`` are preserved.

Why it matters: a small chunk's backward is short (about 60 ms for 290 BERT rows on an H200),
and on a host whose kernel launches are slow the GPU waits for them; ~200 fewer launches per
chunk is host time the GPU no longer waits for.

Not used (plain ``AccumulateGrad``) when something must observe each accumulation: a DDP
module (its reducer hooks ``AccumulateGrad`` and reads ``.grad``) or a parameter with a
post-accumulate-grad hook. Memory: the chunk's new gradients are held until its backward ends
(the chunk-size probe measures the backward the same way, with ``torch.autograd.grad``).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, List, Optional

import torch
from torch import Tensor, nn

from . import walk
from .wrappers import ddp_modules

ENABLED = True  # module switch, for A/B measurements (experiments/); the library leaves it on


def _fusable(model: nn.Module, params: List[nn.Parameter]) -> bool:
    if ddp_modules(model):
        return False
    # a user's post-accumulate hook must see each accumulation (bigbatch's own DDP watch need not)
    return not any(not getattr(h, "bigbatch_watch", False)
                   for p in params for h in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())


def _absorb(params: List[nn.Parameter], aside: List[Optional[Tensor]]) -> None:
    """``aside[i] += params[i].grad`` (what a chunk's backward accumulated), then ``.grad = None``:
    in place in ``aside[i]`` where both are dense tensors of one dtype (fused), else per
    parameter. Both are on the parameter's device: ``.grad``'s setter and autograd's checks of a
    backward's outputs ensure it. (A loop over every parameter per chunk: its checks are identity
    tests, ~0.2 us each.)"""
    fused_old: List[Tensor] = []
    fused_new: List[Tensor] = []
    strided = torch.strided
    for i, p in enumerate(params):
        n = p.grad
        if n is None:
            continue
        p.grad = None
        o = aside[i]
        if o is None:
            aside[i] = n  # the new gradient is the whole gradient
        elif o.layout is strided and n.layout is strided and o.dtype is n.dtype:
            fused_old.append(o)
            fused_new.append(n)
        else:  # sparse gradients (or a dtype mix): as AccumulateGrad would, out of place
            aside[i] = o + n
    if fused_old:
        torch._foreach_add_(fused_old, fused_new)


class GradAccumulation:
    """The fused accumulation of one model over the backwards of its chunks: ``.grad`` is set
    aside at the first :meth:`chunk`, each chunk's gradients are added into the set-aside tensors
    after its backward, and :meth:`finish` puts them back. Between chunks (a re-run's forward
    included) the model's ``.grad`` are ``None``: the per-parameter ``.grad`` writes happen after
    each backward, while the GPU still runs it, instead of between a re-run's forward and its
    backward, when it may have nothing queued. Use it through :func:`accumulating`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = [p for p in walk.parameters(model) if p.requires_grad]
        self.fused = ENABLED and bool(self.params) and _fusable(model, self.params)
        self._aside: Optional[List[Optional[Tensor]]] = None  # .grad as of before the first chunk, plus the chunks'

    @contextlib.contextmanager
    def chunk(self) -> Iterator[None]:
        """Around one chunk's backward: its parameters' gradients end up added into their
        ``.grad`` exactly as plain autograd accumulation would (once :meth:`finish` ran), with
        fewer launches. Gradients reaching tensors outside ``model.parameters()`` accumulate as
        usual."""
        if not self.fused:
            yield
            return
        if self._aside is None:
            old = [p.grad for p in self.params]
            settable = [o is None or (o.dtype == p.dtype and o.device == p.device and o.shape == p.shape)
                        for p, o in zip(self.params, old)]
            if not all(settable):
                # a .grad that .grad's setter would refuse back (another dtype, device or shape,
                # left by a `p.data = ...`) stays in place: autograd accumulates into it as usual
                self.params = list(itertools.compress(self.params, settable))
                old = list(itertools.compress(old, settable))
            self._aside = old
            if any(o is not None for o in old):  # (after zero_grad(): nothing to set aside)
                for p in self.params:
                    p.grad = None
        try:
            yield
        finally:  # also on error: nothing accumulated so far is lost
            _absorb(self.params, self._aside)

    def finish(self) -> None:
        """Put the accumulated gradients back into ``.grad`` (adding what reached it meanwhile
        outside :meth:`chunk`, if anything did)."""
        aside, self._aside = self._aside, None
        if aside is None:
            return
        _absorb(self.params, aside)
        for p, o in zip(self.params, aside):  # (each of the parameter's own dtype, device, shape)
            p.grad = o


class Accumulations:
    """The :class:`GradAccumulation` of the model whose chunks are back-propagated now; another
    model's chunks first put the last one's ``.grad`` back (so a parameter two models share is set
    aside by one at a time)."""

    def __init__(self) -> None:
        self._open: Optional[GradAccumulation] = None

    def of(self, model: nn.Module) -> GradAccumulation:
        if self._open is not None and self._open.model is not model:
            self.finish()
        if self._open is None:
            self._open = GradAccumulation(model)
        return self._open

    def finish(self) -> None:
        acc, self._open = self._open, None
        if acc is not None:
            acc.finish()


@contextlib.contextmanager
def accumulating() -> Iterator[Accumulations]:
    """Around the chunks' backwards of one pass 2: every ``.grad`` is back in place on exit (also
    after an error)."""
    accs = Accumulations()
    try:
        yield accs
    finally:
        accs.finish()
