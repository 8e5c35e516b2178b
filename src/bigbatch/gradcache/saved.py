"""Saved activations held once: saved-tensor hooks for the forwards whose graph gradient caching
back-propagates (re-run chunks, kept chunks, the memory probe).

A chunk's size is set by the activations its forward saves for the backward, and a transformer
saves some of them twice over:

* **autocast copies.** Under ``torch.autocast`` every ``nn.Linear`` casts its fp32 input to half
  precision and saves the copy; the query, key and value projections each cast the same
  LayerNorm output, so three identical copies are kept. Here a cast of a tensor that an earlier
  cast in the same forward already copied to the same dtype and layout is saved as a view of that
  first copy (the node that produced the source identifies it: an in-place write with autograd
  recording gives it a new node).
* **activation outputs.** ``gelu`` saves its input, and the linear layer after it saves its output:
  two tensors of the FFN's width per token. Here the output is not kept: it is recomputed from the
  input gelu saved, when the backward first needs it (one elementwise kernel, before gelu's own
  backward frees that input).

BERT-base under bf16 autocast saves ~27% less per row (2 of the 3 QKV copies + the gelu output:
9 KiB of ~33 KiB per token and layer), so the memory budget fits larger, more efficient chunks.
The backward sees bit-identical tensors (a copy is deterministic; so is the elementwise kernel
re-run on the same input), hence bit-identical gradients (tested).

Saved-tensor hooks switch off autograd's check that a saved tensor was not modified in place
before the backward; every tensor kept here records its version counter and the unpack repeats
that check, with autograd's message. Not caught (documented): a tensor written in place *without*
autograd recording it (under ``torch.no_grad()`` or through ``.data``) between two casts of it to
the same dtype inside one forward -- the second cast would be read back as the first.

Nothing is installed when saved-tensor hooks are already active (the caller's own, e.g.
``torch.autograd.graph.save_on_cpu()``, are kept as they are) or disabled.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

_MODIFIED = ("one of the variables needed for gradient computation has been modified by an inplace "
             "operation: [{what}] is at version {now}; expected version {then} instead. (A tensor saved "
             "for the backward of a gradient-cached forward was written in place after it was saved.)")


def _describe(t: Tensor) -> str:
    return f"{t.type()} {list(t.shape)}"


class _Kept:
    """A tensor saved as autograd would save it, with its version at the time."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def get(self) -> Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(_MODIFIED.format(what=_describe(self.tensor), now=self.tensor._version,
                                                then=self.version))
        return self.tensor


class _ViewOf:
    """A saved view of a cast identical to an earlier, kept cast: that one's storage, this geometry."""

    __slots__ = ("first", "geometry")

    def __init__(self, first: _Kept, geometry: Tuple) -> None:
        self.first = first
        self.geometry = geometry

    def get(self) -> Tensor:
        return self.first.get().as_strided(*self.geometry)


class _Recomputed:
    """A saved view of a gelu output, rebuilt from the input gelu itself saved."""

    __slots__ = ("node", "layout", "geometry")

    def __init__(self, node: Any, layout: Tuple, geometry: Tuple) -> None:
        self.node = node
        self.layout = layout  # the output's (shape, strides, dtype): what the re-run must give back
        self.geometry = geometry

    def get(self) -> Tensor:
        x = self.node._saved_self  # gelu's own saved input (its unpack checks its version)
        with torch.autocast(x.device.type, enabled=False), torch.no_grad():
            y = torch.ops.aten.gelu.default(x, approximate=self.node._saved_approximate)
        if (tuple(y.shape), y.stride(), y.dtype) != self.layout:  # never expected: same op, same input
            raise RuntimeError(f"bigbatch: a recomputed gelu output has layout {(tuple(y.shape), y.stride(), y.dtype)}, "
                               f"the saved one had {self.layout}; pass dedup_saved=False and report this")
        return y.as_strided(*self.geometry)


def _geometry(t: Tensor) -> Tuple:
    return (t.size(), t.stride(), t.storage_offset())


def _unpack(packed: Any) -> Tensor:
    return packed.get()


def hooks_free() -> bool:
    """True when no saved-tensor hooks are active and installing them is allowed."""
    return (torch._C._autograd._saved_tensors_hooks_is_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)


class SavedOnce:
    """Context manager: inside it, the forward's saved tensors are held as described above.

    One instance per forward (the casts it has seen are forgotten on exit; what was saved stays
    valid for the backward). ``counted``: a list whose first element is increased by the bytes of
    every tensor actually kept (the CPU memory probe's estimate)."""

    def __init__(self, enabled: bool = True, counted: Optional[list] = None) -> None:
        self.enabled = enabled
        self.counted = counted
        self._casts: Dict[Tuple, _Kept] = {}
        self._ctx: Any = None

    def __enter__(self) -> "SavedOnce":
        if self.enabled and hooks_free():
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._ctx.__enter__()
        elif self.counted is not None:  # count without changing what is saved
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._count, lambda t: t)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._casts.clear()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(*exc)

    def _count(self, t: Tensor) -> Tensor:
        self.counted[0] += t.numel() * t.element_size()
        return t

    def _keep(self, t: Tensor) -> _Kept:
        if self.counted is not None:
            self.counted[0] += t.numel() * t.element_size()
        return _Kept(t)

    def _pack(self, t: Tensor) -> Any:
        root = t._base if t._base is not None else t
        node = root.grad_fn
        if node is None or root._version != 0:  # (written in place since it was made: kept as is)
            return self._keep(t)
        name = node.name()
        if name == "GeluBackward0" and t.grad_fn is not None:
            # t belongs to the graph below gelu's node, so every backward that reads it runs
            # before gelu's own backward frees the input the recomputation needs
            return _Recomputed(node, (tuple(root.shape), root.stride(), root.dtype), _geometry(t))
        if name == "ToCopyBackward0":
            source, nr = node.next_functions[0]
            if source is not None:
                key = (source, nr, root.dtype, root.device, tuple(root.shape), root.stride(), root.storage_offset())
                first = self._casts.get(key)
                if first is None or first.tensor._version != first.version:  # (the first written since)
                    self._casts[key] = first = self._keep(root)
                return first if t is root else _ViewOf(first, _geometry(t))
        return self._keep(t)
