"""Split encoder inputs along the batch dimension, call a model on a chunk, move chunks between devices.

Inputs are nested structures whose tensor leaves share dimension 0 (the batch): a tensor, a
mapping (``dict``, ``UserDict``, Hugging Face ``BatchEncoding``: the chunk keeps the type), a
list or tuple (type kept), a dataclass instance (a copy with every field cut, ``__init__`` not
run again; called as ``model(chunk)``), or luyug-GradCache style ``(args_list, kwargs_dict)``. Other objects are opaque:
they need a ``split_input_fn``, and tensors inside them are not seen (no input gradients). Non-tensor
leaves and 0-d tensors are repeated in every chunk, except a list or tuple without batched tensors (none,
or only 0-d ones) or a numpy array of exactly B items (lengths, weights; not a ``torch.Size`` or a shape-like tuple of up to 4
ints): it may hold per-row values, so it is an error. Splitting makes views, never copies.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor, nn

from . import walk


def _dataclass(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def _fields(x: Any) -> List[str]:
    """The data attributes of a dataclass instance: its fields (``init=False`` ones included)
    and whatever else its ``__dict__`` holds (attributes set in ``__post_init__``, computed
    ``cached_property`` values), so that every batched tensor it carries is cut with the rest."""
    names = [f.name for f in dataclasses.fields(x)]
    extra = [n for n in getattr(x, "__dict__", {}) if n not in names]
    return names + extra


def _with_fields(x: Any, values: dict) -> Any:
    """A shallow copy of dataclass instance ``x`` with ``values`` set, built without ``__init__``,
    ``__post_init__`` or ``__copy__`` (they ran on ``x``, or may return ``x`` itself; frozen and
    slotted classes too)."""
    out = object.__new__(type(x))
    state = dict(getattr(x, "__dict__", {}))
    for cls in type(x).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                state[name] = getattr(x, name)
    state.update(values)
    for name, v in state.items():
        object.__setattr__(out, name, v)
    return out


def tensor_leaves(x: Any) -> List[Tensor]:
    """Every tensor inside ``x`` (depth-first, mapping values in key order, dataclass fields in order)."""
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, Mapping):
        return [t for v in x.values() for t in tensor_leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensor_leaves(v)]
    if _dataclass(x):
        return [t for name in _fields(x) for t in tensor_leaves(getattr(x, name))]
    return []


def batch_size(x: Any, name: str = "inputs", hint: str = "") -> int:
    """The shared size of dimension 0 of the batched tensor leaves of ``x``.

    Raises ``ValueError`` when there is no batched tensor, the batch is empty, or leaves disagree.
    """
    sizes = {t.shape[0] for t in tensor_leaves(x) if t.dim() > 0}
    if not sizes:
        raise ValueError(f"{name}: expected a tensor or a structure of tensors with a batch dimension, got "
                         f"{type(x).__name__}" + (f" ({hint})" if hint else ""))
    if len(sizes) > 1:
        raise ValueError(f"{name}: tensors disagree on the batch size (dimension 0): {sorted(sizes)}; every "
                         f"tensor with a dimension is cut into chunks along dimension 0, so a tensor shared by all "
                         f"rows goes in as a 0-d tensor, inside the model (a buffer), or through split_input_fn")
    b = sizes.pop()
    if b == 0:
        raise ValueError(f"{name}: empty batch")
    return b


def _rebuild(like: Any, values: Sequence[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # namedtuple
        return type(like)(*values)
    return type(like)(values)


def _remap(like: Mapping, items: dict) -> Any:
    try:
        return type(like)(items)
    except TypeError:  # mapping types that cannot be built from a dict: fall back to a plain dict
        return dict(items)


def split_batch(x: Any, chunk_size: int) -> List[Any]:
    """``x`` cut into consecutive chunks of ``chunk_size`` rows, the one shorter chunk (if B is not a
    multiple) last: ``torch.split``'s and the public GradCache's chunks, so that a model whose output
    depends on the chunking (dropout masks are drawn per chunk, BatchNorm in training) gives the
    public package's result for the same chunk size."""
    if isinstance(chunk_size, numbers.Integral) and not isinstance(chunk_size, bool):
        chunk_size = int(chunk_size)  # numpy ints, as GradCache's chunk_sizes accepts them
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    b = batch_size(x)
    n = -(-b // chunk_size)
    return split_rows(x, [chunk_size] * (n - 1) + [b - (n - 1) * chunk_size])


def planned_rows(b: int, fit: int) -> List[int]:
    """Chunk rows for ``b`` rows when at most ``fit`` fit the memory budget: the last chunk has
    ``fit`` rows (it is the one whose pass-1 graph GradCache can keep, so the larger the better)
    and the rows before it are split into as few chunks as fit, of equal size (+-1): no short
    tail costing a whole chunk's launch overhead for a few rows. A one-row chunk only where
    unavoidable (``fit`` < 3): one row more than ``fit`` is cut 2 + (fit - 1), since a one-row
    chunk fails BatchNorm in training ("expected more than 1 value per channel"), which the
    batch itself would pass."""
    if b <= fit:
        return [b]
    rest = b - fit
    if rest == 1 and fit >= 3:
        return [2, fit - 1]
    n = -(-rest // fit)
    return [rest // n + (1 if i >= n - rest % n else 0) for i in range(n)] + [fit]


def split_chunks(x: Any, chunk: int, *, split_input_fn: Optional[Callable[[Any, int], List[Any]]] = None,
                 from_budget: bool = False) -> List[Any]:
    """The chunks of one input: ``split_input_fn(x, chunk)`` when given; for a budget-sized
    ``chunk`` (the largest that fits) :func:`planned_rows` (largest chunk last, the rest even);
    for a chosen chunk size, chunks of that size with the short one last (as the public GradCache)."""
    if split_input_fn is not None:
        chunks = list(split_input_fn(x, chunk))
        if not chunks:
            raise ValueError("split_input_fn returned no chunks")
        return chunks
    if from_budget:
        return split_rows(x, planned_rows(batch_size(x), chunk))
    return split_batch(x, chunk)


def _per_row_lookalike(v: Any, b: int) -> bool:
    """A list or tuple without batched tensors (none, or only 0-d ones: ``[torch.tensor(1.), ...]``)
    or a numpy-like array of exactly ``b`` items: it cannot be told from per-row values, which
    repeating in every chunk would get wrong. A ``torch.Size`` and a short tuple of ints (up to 4:
    ``size=(224, 224)``, a shape) are settings, repeated."""
    if isinstance(v, (str, bytes, torch.Size, Tensor, Mapping)) or _dataclass(v) or not hasattr(v, "__len__"):
        return False
    if isinstance(v, (list, tuple)) and any(t.dim() > 0 for t in tensor_leaves(v)):
        return False
    if isinstance(v, tuple) and len(v) <= 4 and all(isinstance(i, int) for i in v):
        return False
    try:
        return len(v) == b
    except TypeError:  # a 0-d numpy array
        return False


def split_rows(x: Any, rows: Sequence[int]) -> List[Any]:
    """``x`` cut into consecutive chunks of ``rows[i]`` rows (views; ``sum(rows)`` must be B)."""
    b = batch_size(x)
    if sum(rows) != b or any(r < 1 for r in rows):
        raise ValueError(f"chunk rows {list(rows)} do not split a batch of {b} rows")
    bounds, start = [], 0
    for r in rows:
        bounds.append((start, start + r))
        start += r

    def cut(v: Any, i: int) -> Any:
        if isinstance(v, Tensor):
            return v if v.dim() == 0 else v[bounds[i][0] : bounds[i][1]]
        if isinstance(v, Mapping):
            return _remap(v, {k: cut(w, i) for k, w in v.items()})
        if len(rows) > 1 and _per_row_lookalike(v, b):
            raise ValueError(
                f"inputs: a {type(v).__name__} of {b} items without batched tensors sits beside tensors of {b} rows; "
                f"bigbatch cuts only tensors, so it would reach every chunk whole (per-row values, e.g. "
                f"lengths, would be wrong): pass per-row values as a tensor, or give split_input_fn")
        if isinstance(v, (list, tuple)):
            return _rebuild(v, [cut(w, i) for w in v])
        if _dataclass(v):
            return _with_fields(v, {name: cut(getattr(v, name), i) for name in _fields(v)})
        return v

    return [cut(x, i) for i in range(len(rows))]


def map_tensors(x: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``x`` with ``fn`` applied to every tensor leaf (structure and types kept)."""
    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        return _remap(x, {k: map_tensors(v, fn) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return _rebuild(x, [map_tensors(v, fn) for v in x])
    if _dataclass(x):
        return _with_fields(x, {name: map_tensors(getattr(x, name), fn) for name in _fields(x)})
    return x


def chunk_rows(chunk: Any, custom: bool, name: str) -> Optional[int]:
    """The rows of a chunk; ``None`` for a chunk of a custom type (``custom``: it came from a
    ``split_input_fn`` and holds no batched tensor where :func:`tensor_leaves` looks), whose rows
    are then read from its representation."""
    if custom and not any(t.dim() > 0 for t in tensor_leaves(chunk)):
        return None
    return batch_size(chunk, name)


def differentiable(t: Tensor) -> bool:
    """A representation that can carry a gradient: floating or complex (``is_floating_point()`` is
    False for complex tensors)."""
    return t.is_floating_point() or t.is_complex()


def call_model(model: nn.Module, x: Any) -> Any:
    """Call ``model`` on one chunk: tensor -> ``model(x)``; mapping -> ``model(**x)``;
    ``(list, dict)`` -> ``model(*args, **kwargs)``; other list/tuple -> ``model(*x)``; any other
    object (a custom batch type from ``split_input_fn``) -> ``model(x)``."""
    if isinstance(x, Tensor):
        return model(x)
    if isinstance(x, Mapping):
        try:
            return model(**x)
        except TypeError as exc:
            missing = _required_not_in(model, x)
            if not missing:
                raise
            raise TypeError(
                f"{exc} -- bigbatch calls a model on a dict input as model(**inputs), and the dict has no "
                f"entry for this model's required argument(s) {missing}: a model that takes the dict as one "
                f"argument (a SentenceTransformer) needs the input wrapped as [inputs]") from exc
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], list) and isinstance(x[1], Mapping):
        return model(*x[0], **x[1])
    if isinstance(x, (list, tuple)):
        return model(*x)
    return model(x)


def _required_not_in(model: nn.Module, x: Mapping) -> List[str]:
    """The required arguments of ``model``'s forward that ``x`` has no key for (a call
    ``model(**x)`` cannot fill them)."""
    inner = getattr(model, "bigbatch_encoder", None)  # a WithHead (head.py): the encoder takes the input
    model = inner if isinstance(inner, nn.Module) else model
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    return [n for n in required if n not in x]


def model_device(model: nn.Module, inputs: Any = None) -> torch.device:
    """The device of the model's first parameter (or buffer): where its chunks are staged. A model
    that registers neither (a wrapper applying weights through ``torch.func.functional_call``)
    runs where its ``inputs`` are: the device of their first tensor (CPU if they hold none)."""
    for t in walk.parameters(model):  # (memoised within a step: walk.py)
        return t.device
    for t in walk.buffers(model):
        return t.device
    for t in tensor_leaves(inputs):
        return t.device
    return torch.device("cpu")


def check_offload_target(models: Sequence[nn.Module]) -> None:
    """``offload_inputs`` copies each chunk to its model's device: every model must have one."""
    for m in models:
        if not (any(True for _ in m.parameters()) or any(True for _ in m.buffers())):
            raise ValueError(
                f"offload_inputs=True copies each chunk to its model's device, and {type(m).__name__} registers no "
                "parameter or buffer to tell which: keep its inputs on the device it runs on (offload_inputs=False), "
                "or register a parameter or buffer in it")


def pin(x: Any) -> Any:
    """CPU tensor leaves moved to pinned memory (only when CUDA exists; otherwise ``x`` unchanged)."""
    if not torch.cuda.is_available():
        return x
    return map_tensors(x, lambda t: t if (t.is_cuda or t.is_pinned()) else t.pin_memory())


def to_device(x: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return map_tensors(x, lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking))


def staged(chunks: Sequence[Any], device: torch.device, overlap: bool) -> Iterator[Any]:
    """Yield ``chunks`` on ``device``. With ``overlap`` on CUDA, chunk i+1 is copied on a side
    stream while chunk i computes (pinned sources make the copy truly asynchronous); the
    consumer stream waits for the copy and the copies are recorded on it so the caching
    allocator never reuses them early. Up to three chunks are on the device at a time: the one
    computed, the next being copied, and the previous one while the caller's loop still holds it."""
    if not (overlap and device.type == "cuda"):
        for c in chunks:
            yield to_device(c, device)
        return
    copy_stream = torch.cuda.Stream(device=device)
    compute = torch.cuda.current_stream(device)

    def issue(c: Any) -> Any:
        copy_stream.wait_stream(compute)  # the source may have been written on the compute stream
        with torch.cuda.stream(copy_stream):
            return to_device(c, device, non_blocking=True)

    nxt: Optional[Any] = issue(chunks[0]) if chunks else None
    for i in range(len(chunks)):
        cur = nxt
        compute.wait_stream(copy_stream)
        map_tensors(cur, lambda t: (t.record_stream(compute), t)[1] if t.is_cuda else t)
        nxt = issue(chunks[i + 1]) if i + 1 < len(chunks) else None
        yield cur


def check_not_detached(rep: Tensor, out: Any) -> None:
    """A representation without grad from a model output that has one: ``get_rep_fn`` detached it
    (an output without any means the forward used no trainable tensor: nothing to send)."""
    if not rep.requires_grad and any(t.requires_grad for t in tensor_leaves(out)):
        raise ValueError(
            f"get_rep_fn returned a representation that does not require grad ({rep.dtype}"
            f"{', detached' if rep.is_floating_point() else ''}) from an encoder that is trained: it must be a "
            "floating tensor computed from the model's output without .detach() or torch.no_grad()"
        )
