"""Buffers a forward updates (BatchNorm's running statistics and batch counter, any module's
step counters) see each chunk's forward once, as in a plain chunked loop: pass 2 re-runs
forwards that pass 1 already ran, so it restores the buffers it changed. A forward that also
*reads* what it updates (``nn.utils.spectral_norm``'s power-iteration vectors, a running scale)
must see in its re-run the values its first run saw: :class:`BufferStates` keeps them per chunk.

With BatchNorm in training mode every chunk is normalised with its own statistics, in both
passes alike, so the gradients are exactly those of that chunked model; they are not those of
one forward over the whole batch (no chunked scheme's are).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterable, Iterator, List, Tuple

from torch import Tensor, nn


def _buffer_slots(modules: Iterable[nn.Module]) -> List[Tuple[nn.Module, str]]:
    """(module, name) of every buffer of ``modules``, each submodule once (shared ones included)."""
    slots, seen = [], set()
    for model in modules:
        for mod in model.modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            slots += [(mod, name) for name, buf in mod._buffers.items() if buf is not None]
    return slots


def _put(mod: nn.Module, name: str, value: Tensor) -> None:
    """Give buffer ``name`` of ``mod`` the value ``value`` (not aliased: ``value`` stays a snapshot);
    in place without an autograd version bump when the shapes agree, so the buffer's identity is kept."""
    buf = mod._buffers.get(name)
    if buf is not None and buf.shape == value.shape and buf.dtype == value.dtype and buf.device == value.device:
        buf.data.copy_(value)
    else:
        mod._buffers[name] = value.clone()


class BufferStates:
    """The buffers of ``modules`` as each pass-1 forward found them, so that its pass-2 re-run
    starts from the same values.

    ``before()`` / ``after()`` bracket each pass-1 forward; ``before`` returns the chunk's record.
    A buffer counts as changing once some forward re-assigned it or bumped its autograd version
    (in-place ops and ``out=`` do; BatchNorm's running statistics, updated inside its kernel, do
    not, and BatchNorm in training mode does not read them). Memory: one copy of all buffers (the
    state before the first chunk) plus, per chunk, a copy of the buffers seen changing so far."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.slots = _buffer_slots(modules)
        self.initial = {i: mod._buffers[name].detach().clone() for i, (mod, name) in enumerate(self.slots)}
        self.changing: Dict[int, None] = {}  # slot indices, in the order they were seen changing
        self._marks: List[Tuple[int, int]] = []

    def _mark(self) -> List[Tuple[int, int]]:
        out = []
        for mod, name in self.slots:
            buf = mod._buffers.get(name)
            out.append((id(buf), buf._version if buf is not None else -1))
        return out

    def before(self) -> Dict[int, Tensor]:
        self._marks = self._mark()
        return {i: self.slots[i][0]._buffers[self.slots[i][1]].detach().clone() for i in self.changing}

    def after(self) -> None:
        for i, (now, was) in enumerate(zip(self._mark(), self._marks)):
            if now != was and i not in self.changing:
                self.changing[i] = None  # its value before this and every earlier chunk: ``initial``

    def restore(self, record: Dict[int, Tensor]) -> None:
        """Put every changing buffer back to its value before the pass-1 forward of ``record``'s chunk."""
        for i in self.changing:
            mod, name = self.slots[i]
            _put(mod, name, record.get(i, self.initial[i]))


@contextlib.contextmanager
def buffers_restored(modules: Iterable[nn.Module]) -> Iterator[None]:
    """On exit, every buffer of ``modules`` holds its value from entry. A buffer changed in place
    is copied back in place (its identity, which DDP's buffer broadcast relies on, is kept) without
    bumping its autograd version: graphs saved before entry saw exactly the entry value, which is
    what they see again (BatchNorm's own in-place updates do not bump it either, and a version bump
    would fail such a graph's backward); a buffer the forward re-assigned is put back. Memory: one
    copy of the buffers. Leave the context only after the backward of what ran inside it."""
    saved: List[Tuple[nn.Module, str, Tensor, Tensor]] = [
        (mod, name, mod._buffers[name], mod._buffers[name].detach().clone()) for mod, name in _buffer_slots(modules)
    ]
    try:
        yield
    finally:
        for mod, name, buf, value in saved:
            if mod._buffers.get(name) is buf:
                buf.data.copy_(value)  # .data: the same storage, not the version counter
            else:
                mod._buffers[name] = value
