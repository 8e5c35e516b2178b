"""Buffers a forward updates (BatchNorm's running statistics and batch counter, any module's
step counters) see each chunk's forward once, as in a plain chunked loop: pass 2 re-runs
forwards that pass 1 already ran, so it restores the buffers it changed.

With BatchNorm in training mode every chunk is normalised with its own statistics, in both
passes alike, so the gradients are exactly those of that chunked model; they are not those of
one forward over the whole batch (no chunked scheme's are).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List, Tuple

from torch import Tensor, nn


@contextlib.contextmanager
def buffers_restored(modules: Iterable[nn.Module]) -> Iterator[None]:
    """On exit, every buffer of ``modules`` holds its value from entry. A buffer changed in place
    is copied back in place (its identity, which DDP's buffer broadcast relies on, is kept) without
    bumping its autograd version: graphs saved before entry saw exactly the entry value, which is
    what they see again (BatchNorm's own in-place updates do not bump it either, and a version bump
    would fail such a graph's backward); a buffer the forward re-assigned is put back. Memory: one
    copy of the buffers. Leave the context only after the backward of what ran inside it."""
    saved: List[Tuple[nn.Module, str, Tensor, Tensor]] = []
    seen = set()
    for model in modules:
        for mod in model.modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            for name, buf in mod._buffers.items():
                if buf is not None:
                    saved.append((mod, name, buf, buf.detach().clone()))
    try:
        yield
    finally:
        for mod, name, buf, value in saved:
            if mod._buffers.get(name) is buf:
                buf.data.copy_(value)  # .data: the same storage, not the version counter
            else:
                mod._buffers[name] = value
