"""Memory budgets and the automatic chunk size: the largest chunk whose forward + backward fits.

A budget caps the step's peak memory. On CUDA that is the device's whole allocation
(``torch.cuda.memory_allocated``: weights, optimizer state and ``.grad`` included), so the bytes
already allocated when the step starts come out of the budget. On the CPU, which has no allocator
statistics, a budget is the (estimated) memory the step adds.

Probe (once per model, input shape beyond the batch dimension, dtype and autocast setting):
run forward + backward of two small chunks ``c1 < c2`` and fit ``peak(c) = fixed + per_row * c``
(on CUDA after one unmeasured run of ``c1``, so one-time allocations are not fitted). On CUDA
the chunk planned from that line is then measured itself, as the line extrapolates: a compiled
model's peak grows slower beyond the probe's rows (an H200, torch.compile'd BERT-base: 64.7 MiB/row
between 16 and 48 rows, 35.5 between 48 and 128), and a model whose peak grows faster must not be
planned past its budget. Up to :data:`_PLAN_MEASURES` such points refine the cost model
(piecewise linear through them) per cost.

* CUDA: ``peak`` is ``torch.cuda.max_memory_allocated()`` above the allocation before the probe,
  ``act`` (memory held by the graph after the forward) likewise.
* CPU (no allocator statistics): ``act`` is the bytes of the tensors autograd saves for the
  backward (``saved_tensors_hooks``) and ``peak`` is taken as ``2 * act`` (the backward holds the
  activations and their gradients). An estimate; on CPU a budget is a guide, not a guarantee.

The probe uses ``torch.autograd.grad`` (for models with reentrant activation checkpointing, which
refuses it, a ``.backward()``) with the ``.grad`` and gradient hooks of every leaf it reaches set
aside, a forked random state and a copy of the model's buffers (restored afterwards), so it
changes nothing the step can see (forward hooks, as a forward's, run).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import numbers
import re
import types
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from .buffers import buffers_restored
from .graph import graph_leaves
from .head import identity_of
from .hooks import leaf_grads_set_aside
from .lazy import buffers_reset_after
from .norms import fast_layer_norms, model_norms
from .chunking import (batch_size, call_model, check_not_detached, map_tensors, model_device, split_batch,
                       tensor_leaves, to_device)
from .rng import forked_rng, model_cuda_devices
from .wrappers import ddp_bypassed
from . import walk

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

MemoryArg = Union[int, float, str, None]


def parse_memory(value: MemoryArg, name: str = "memory_budget") -> Optional[int]:
    """Bytes from an int/float or a string like ``"16GiB"``, ``"500 MB"``; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be bytes (int) or a string like '16GiB', got bool")
    if isinstance(value, numbers.Integral):  # numpy integers too
        out = raw = int(value)
    elif isinstance(value, numbers.Real):
        try:
            finite = math.isfinite(value)
        except OverflowError:  # a Fraction beyond a float's range: a finite, huge number of bytes
            finite = True
        if not finite:
            raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
        out, raw = int(value), value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        number = float(m.group(1)) if m else math.nan
        if not m or m.group(2).lower() not in _UNITS or not math.isfinite(number):
            raise ValueError(f"{name}: cannot read {value!r}; use bytes or e.g. '16GiB', '512MiB', '8GB'")
        raw = number * _UNITS[m.group(2).lower()]
        out = int(raw)
    else:
        raise TypeError(f"{name} must be bytes (int) or a string like '16GiB', got {type(value).__name__}")
    if out <= 0:
        rounded = out == 0 and raw > 0  # e.g. 0.3 or "0.0001B"
        raise ValueError(f"{name} must be positive, got {value!r}" + (" (it rounds down to 0 bytes)" if rounded else ""))
    return out


def size(n: float) -> str:
    """``n`` bytes for a message: ``"12.5 KiB"``, ``"15.3 GiB"`` (3 significant digits)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


@dataclass(frozen=True)
class ChunkCost:
    """Memory model of one chunk: ``fixed + per_row * rows`` at the forward+backward peak,
    ``act_fixed + act_per_row * rows`` held by a kept graph between the forward and its backward
    (e.g. the half-precision weight copies autocast saves for the backward are the fixed part),
    and ``rep_per_row`` bytes of representation per row (cached for the whole batch, with its
    gradient).

    Refined on CUDA by chunks ``measured`` at planned sizes, ``(rows, peak, held)`` by rows, each
    beyond ``probe_rows`` (the larger probe chunk, whose own ``probe_peak`` / ``probe_held`` were
    measured too): the model is then piecewise linear through the measured points from the probe's
    (never decreasing; the lines, which lie above the probes, capped at the probe's values below
    ``probe_rows``), and beyond the last point it rises at the steeper of its last segment and its
    chord from the probe -- or, if the measured points do not rise above the probe (allocator
    noise), at ``per_row``: a flat extension would plan the whole batch."""

    fixed: float
    per_row: float
    act_per_row: float
    rep_per_row: float = 0.0
    act_fixed: float = 0.0
    probe_rows: int = 0
    probe_peak: float = 0.0
    probe_held: float = 0.0
    measured: Tuple[Tuple[int, float, float], ...] = ()

    def cached(self, rows: int) -> float:
        """Bytes of the cached representations of ``rows`` rows and their gradients (same dtype)."""
        return 2.0 * self.rep_per_row * rows

    def peak(self, rows: int) -> float:
        return self._refined(rows, 1, self.fixed + self.per_row * rows, self.probe_peak, self.per_row)

    def held(self, rows: int) -> float:
        """Bytes a kept graph of ``rows`` rows holds; never more than the chunk's own forward +
        backward peak, which contains that graph (so a chunk that fits may always be kept alone)."""
        line = self._refined(rows, 2, self.act_fixed + self.act_per_row * rows, self.probe_held, self.act_per_row)
        return min(line, self.peak(rows))

    def near_measured(self, rows: int, tolerance: float) -> bool:
        """Whether ``rows`` is within ``tolerance`` (relative) of a measured chunk or the probe."""
        return any(abs(rows - r) <= tolerance * r for r in [self.probe_rows] + [r for r, _, _ in self.measured])

    def with_point(self, rows: int, peak: float, held: float) -> "ChunkCost":
        """This cost with a measurement at ``rows`` (beyond ``probe_rows``) added (replacing one at
        the same rows)."""
        rows = int(rows)
        if rows <= self.probe_rows:
            raise ValueError(f"a measured chunk refines the cost beyond the probe's {self.probe_rows} rows, got {rows}")
        points = {r: (r, p, h) for r, p, h in self.measured}
        points[rows] = (rows, float(peak), float(held))
        return replace(self, measured=tuple(sorted(points.values())))

    def _refined(self, rows: int, which: int, line: float, at_probe: float, line_slope: float) -> float:
        if not self.measured:
            return line
        if rows <= self.probe_rows:  # the line lies above the probe; a chunk this small peaks below it
            return min(line, at_probe)
        knots = [(self.probe_rows, at_probe)]
        for point in self.measured:  # never decreasing with more rows (allocator noise aside)
            if point[0] > knots[-1][0]:
                knots.append((point[0], max(point[which], knots[-1][1])))
        for (r0, v0), (r1, v1) in zip(knots, knots[1:]):
            if rows <= r1:  # (clamped: float rounding must not make the peak fall by an ulp)
                return min(max(v0 + (v1 - v0) * (rows - r0) / (r1 - r0), v0), v1)
        (r0, v0), (r1, v1) = knots[-2], knots[-1]
        slope = max((v1 - v0) / (r1 - r0), (v1 - at_probe) / (r1 - self.probe_rows))
        return v1 + (slope if slope > 0 else line_slope) * (rows - r1)

    def largest_chunk(self, budget: int, cap: int) -> int:
        """The largest row count (at most ``cap``, the batch) whose peak fits ``budget``, so that
        peak memory does not grow with B; ``ValueError`` if not even one row fits."""
        if self.peak(1) > budget:
            raise ValueError(
                f"memory_budget is too small for even one example: it leaves {size(budget)} for a "
                f"chunk (after what is allocated, slack and the cached representations), and forward + "
                f"backward of one row takes about {size(self.peak(1))}"
            )
        lo, hi = 1, max(1, cap)  # peak() never falls with the rows: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.peak(mid) <= budget else (lo, mid - 1)
        return lo


def _on(t: Tensor, device: torch.device) -> bool:
    """Whether ``t`` lives on ``device`` (``cuda`` without an index: the current device)."""
    if t.device.type != device.type:
        return False
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return t.device.index == index


def sparse_tables(model: nn.Module) -> Set[int]:
    """``id``s of the model's sparse embedding tables: their ``.grad`` holds only the rows a batch
    touched (a few bytes per row, which the probe's per-row cost covers), not the table."""
    return {id(m.weight) for m in walk.submodules(model) if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


def grads_to_come(models: Sequence[nn.Module], device: torch.device) -> int:
    """Bytes of the ``.grad`` tensors a step will create on ``device``: a trainable parameter there
    whose ``.grad`` is ``None`` at the start (as ``zero_grad()`` leaves it) adopts the first re-run
    chunk's gradient, and from the second chunk on that ``.grad`` is held beside the chunk's own new
    gradients (which the probe's fixed part counts). Parameters shared by several models count
    once; sparse embedding tables not at all."""
    seen, total = set(), 0
    for model in models:
        seen.update(sparse_tables(model))
        for p in walk.parameters(model):
            if p.requires_grad and p.grad is None and id(p) not in seen and _on(p, device):
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def in_use_at_start(devices: Sequence[torch.device], models: Sequence[nn.Module]) -> int:
    """What the budget loses before any chunk runs, on the device that has least left: on CUDA the
    bytes allocated before the step (0 on the CPU, where a budget is what the step adds), plus the
    ``.grad`` tensors the step will create there (:func:`grads_to_come`)."""
    total = 0
    for d in {(d.type, d.index) for d in devices}:
        device = torch.device(*d) if d[1] is not None else torch.device(d[0])
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        total = max(total, allocated + grads_to_come(models, device))
    return total


def offloads(offload_reps: bool, device: torch.device) -> bool:
    """Whether ``offload_reps`` takes the cached representations off ``device`` between the passes
    (on the CPU they stay where they are: the plan must count them)."""
    return offload_reps and device.type != "cpu"


def planning_budget(budget: int, fraction: float, cached: float, in_use: int = 0, can_offload: bool = True) -> int:
    """The bytes chunks and kept graphs are planned against: ``fraction`` of what ``budget`` leaves
    above ``in_use`` (the bytes allocated before the step and the ``.grad`` it creates; slack for
    allocator rounding and the loss) less ``cached``, the bytes of the whole batch's cached
    representations and their gradients, which live through the whole step (``can_offload``:
    ``offload_reps`` would move them off the device, for the error's advice)."""
    if in_use >= budget:
        raise ValueError(
            f"memory_budget of {size(budget)} is already taken by {size(in_use)}: the .grad tensors the step "
            "creates (parameters whose .grad is None) and, on CUDA, what is allocated before the step "
            "(weights, optimizer state, gradients): raise it"
        )
    usable = int((budget - in_use) * fraction - cached)
    if usable <= 0:
        need = in_use + cached / fraction  # the budget below which nothing is left for a chunk
        raise ValueError(
            f"memory_budget of {size(budget)} cannot hold the cached representations and their "
            f"gradients ({size(cached)}) and leave room for a chunk: {size(in_use)} of it go "
            f"to the .grad tensors the step creates and, on CUDA, what is allocated before the step, and "
            f"{(1 - fraction) * 100:.0f}% of the rest is slack; raise it well above {size(need)}"
            + (", or pass offload_reps=True to keep the representations on the CPU" if can_offload else "")
        )
    return usable


def probe_cost(prober: "ChunkProber", model: nn.Module, x: Any, get_rep: Callable[[Any], Tensor],
               autocast_ctx: Callable[[], Any], autocast: Optional[torch.dtype], *, custom_split: bool) -> "ChunkCost":
    """``prober.cost(...)`` (:func:`_probe_errors`)."""
    with _probe_errors(custom_split):
        return prober.cost(model, x, get_rep, autocast_ctx, autocast)


def plan_chunk(prober: "ChunkProber", model: nn.Module, x: Any, get_rep: Callable[[Any], Tensor],
               autocast_ctx: Callable[[], Any], autocast: Optional[torch.dtype], cost: "ChunkCost", budget: int, *,
               custom_split: bool) -> Tuple[int, "ChunkCost"]:
    """``prober.plan(...)``: the largest chunk that fits ``budget`` and its (refined) cost (:func:`_probe_errors`)."""
    with _probe_errors(custom_split):
        return prober.plan(model, x, get_rep, autocast_ctx, autocast, cost, budget)


@contextlib.contextmanager
def _probe_errors(custom_split: bool) -> Iterator[None]:
    """A clear error when a ``split_input_fn`` is in use and the model cannot run on the probe's
    row slices of the raw input (it takes only the custom chunks)."""
    try:
        yield
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        if not custom_split:
            raise
        raise ValueError(
            f"a memory budget probes the model on row slices of the input cut by bigbatch, not by "
            f"split_input_fn, and the model failed on them ({type(exc).__name__}: {exc}): give a chunk "
            f"size (and no memory_budget) with this split_input_fn") from exc


def _signature(model: nn.Module, x: Any, autocast: Optional[torch.dtype]) -> Tuple:
    """What a chunk's memory depends on besides its rows: the input's per-row shapes, the autocast
    dtype, and the model -- its parameters (identity, dtype, device, which ones require grad: a
    tower unfrozen after warm-up builds a graph it did not before) and train/eval modes (dropout
    masks are saved in training)."""
    leaves = tuple((tuple(t.shape[1:]), t.dtype, t.requires_grad) for t in tensor_leaves(x))
    params = tuple((id(p), p.dtype, p.device, p.requires_grad) for p in walk.parameters(model))
    modes = tuple(m.training for m in walk.submodules(model))
    return (identity_of(model), params, modes, leaves, autocast)


def callable_key(fn: Any, depth: int = 0) -> Tuple:
    """What identifies ``get_rep_fn`` for the probe cache, i.e. what its memory may depend on: a
    function's code, and what its closure cells, defaults, ``self`` and (for ``get_rep_fn`` itself)
    the globals its code names hold (:func:`_fingerprint`); a partial's function and arguments;
    else the callable object itself (a module). A lambda rewritten every step in a training loop --
    a new object, the same code over the same modules -- is not probed again, also when it closes
    over a per-step float or a tensor of the same shape; a projection module swapped for another, a
    different slice width (an int) or key (a string) is a new probe. Always hashable."""
    key = _callable_key(fn, depth)
    try:
        hash(key)
    except Exception:  # an object whose hash fails somewhere inside: the callable's identity
        return ("id", id(fn))
    return key


def _callable_key(fn: Any, depth: int) -> Tuple:
    if isinstance(fn, functools.partial):
        return ("partial", _fingerprint(fn.func, depth + 1), tuple(_fingerprint(a, depth + 1) for a in fn.args),
                tuple(sorted((k, _fingerprint(v, depth + 1)) for k, v in fn.keywords.items())))
    if not isinstance(fn, (types.FunctionType, types.MethodType)):
        return _fingerprint(fn, depth)
    func = fn.__func__ if isinstance(fn, types.MethodType) else fn
    if not isinstance(func, types.FunctionType):  # a method of a builtin
        return _fingerprint(fn, depth)
    cells = tuple(_fingerprint(c.cell_contents, depth + 1) for c in (func.__closure__ or ()) if _filled(c))
    defaults = tuple(_fingerprint(d, depth + 1) for d in (func.__defaults__ or ()))
    kwdefaults = tuple(sorted((k, _fingerprint(v, depth + 1)) for k, v in (func.__kwdefaults__ or {}).items()))
    # the globals named by get_rep_fn's own code (co_names also lists attribute names: a global of
    # that name is then fingerprinted for nothing, harmlessly); not those of functions it calls
    names = tuple((n, _fingerprint(func.__globals__[n], depth + 1, numbers=False)) for n in func.__code__.co_names
                  if n in func.__globals__) if depth == 0 else ()
    owner = _fingerprint(fn.__self__, depth + 1) if isinstance(fn, types.MethodType) else None
    return ("code", func.__code__, cells, defaults, kwdefaults, names, owner)


def _fingerprint(obj: Any, depth: int, numbers: bool = True) -> Any:
    """A hashable stand-in for ``obj`` in :func:`callable_key`: numbers that cannot size anything
    (floats, numpy's included) by type; ints (a slice width) by value where ``numbers`` (closure
    cells, defaults, partial arguments), by type for a global (a step counter there would re-probe
    every step); strings and bools by value; tensors by shape, dtype, device and requires_grad;
    functions and partials by their own key; small lists, tuples and dicts by their items; any other
    hashable object by a weak reference (its identity while it lives: a new object at a freed one's
    address is not taken for it), else by ``id``."""
    if obj is None or isinstance(obj, (float, complex, np.floating)):
        return type(obj).__name__
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        return (type(obj).__name__, int(obj)) if numbers else type(obj).__name__
    if isinstance(obj, (bool, str, bytes, torch.dtype, torch.device)):
        return (type(obj).__name__, obj)
    if isinstance(obj, Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.device, obj.requires_grad)
    if depth < 4 and isinstance(obj, (functools.partial, types.FunctionType, types.MethodType)):
        return _callable_key(obj, depth)
    if depth < 4 and type(obj) in (list, tuple) and len(obj) <= 16:
        return (type(obj).__name__, tuple(_fingerprint(o, depth + 1) for o in obj))
    if depth < 4 and type(obj) is dict and len(obj) <= 16:
        return ("dict", tuple((_fingerprint(k, depth + 1), _fingerprint(v, depth + 1)) for k, v in obj.items()))
    try:
        hash(obj)
        return ("object", weakref.ref(obj))
    except Exception:  # unhashable (a dataclass, a set, an array) or no weak references
        return ("id", id(obj))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _rep_bytes(rep: Tensor) -> float:
    return float(rep.numel() * rep.element_size())


def _get_rep(get_rep, out: Any, graph: bool = False) -> Tensor:
    """``graph``: a forward with a graph to back-propagate; a representation without one is an
    error if ``get_rep`` detached it, else (the forward used no trainable tensor, as a wrapper of
    only a frozen tower) the probe measures the forward alone, as the step will run it."""
    rep = get_rep(out)
    if not isinstance(rep, Tensor):
        raise TypeError(f"get_rep_fn must return a tensor, got {type(rep).__name__}; pass get_rep_fn=...")
    if graph:
        check_not_detached(rep, out)
    return rep


def _backward(rep: Tensor, targets: List[Tensor], by_grad: bool) -> None:
    """The probe's backward, which nobody may see: every leaf it reaches has its ``.grad`` and its
    gradient hooks set aside for it (a gradient logger must not record the probe's made-up
    gradients). ``torch.autograd.grad`` over ``targets``, or -- for models with reentrant activation
    checkpointing, which refuses ``autograd.grad`` -- ``.backward()``."""
    with leaf_grads_set_aside(targets + graph_leaves(rep)):
        if by_grad:
            torch.autograd.grad(rep, targets, grad_outputs=torch.ones_like(rep), allow_unused=True)
        else:
            rep.backward(torch.ones_like(rep))


def _measure(model, x, get_rep, autocast_ctx, params, device, by_grad: bool = True) -> Tuple[float, float, float]:
    """(peak, act, representation) bytes of one forward + backward of chunk ``x`` (gradients for
    ``params`` and the chunk's tensors that require grad, which ``x`` holds as leaves of its own);
    with neither (a frozen model fed plain inputs) of its forward alone, without a graph (nothing
    is held: ``act`` = 0)."""
    params = list(params) + [t for t in tensor_leaves(x) if t.requires_grad]
    train = bool(params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with fast_layer_norms(model_norms(model)):  # as the step will run it (engine.py)
            with autocast_ctx(), torch.set_grad_enabled(train):
                rep = _get_rep(get_rep, call_model(model, x), graph=train)
            act = torch.cuda.memory_allocated(device) - base if train else 0
            rep_bytes = _rep_bytes(rep)
            if rep.requires_grad:
                _backward(rep, params, by_grad)
            del rep
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - base), float(act), rep_bytes
    if not train:  # CPU, frozen model: twice the bytes of its output, a rough guide
        with torch.no_grad(), autocast_ctx():
            out = call_model(model, x)
            rep = _get_rep(get_rep, out)
        out_bytes = sum(t.numel() * t.element_size() for t in tensor_leaves(out))
        return float(2 * out_bytes), 0.0, _rep_bytes(rep)
    saved = [0]
    # Tensors saved for the backward that are the model's own weights or buffers (a Linear saves
    # its weight) or the chunk's inputs already exist: the step adds nothing for them (counted
    # before: all-MiniLM-L6-v2's 41 MiB of weights, twice, in a 7-row probe of 51 MiB saved).
    own = itertools.chain(walk.parameters(model), walk.buffers(model)) if isinstance(model, nn.Module) else ()
    existing = {_storage_ptr(t) for t in itertools.chain(own, tensor_leaves(x))}
    existing.discard(None)

    def pack(t: Tensor) -> Tensor:
        if _storage_ptr(t) not in existing:
            saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_ctx():
        rep = _get_rep(get_rep, call_model(model, x), graph=True)
    if rep.requires_grad:
        _backward(rep, params, by_grad)
    sparse = sparse_tables(model)
    grads = sum(p.numel() * p.element_size() for p in params if id(p) not in sparse)
    return float(2 * saved[0] + grads), float(saved[0]), _rep_bytes(rep)


def _storage_ptr(t: Tensor) -> Optional[int]:
    """Address of ``t``'s storage (shared by its views), or None (no storage: sparse, meta, ...)."""
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):  # e.g. an uninitialised lazy parameter
        return None
    return ptr or None


_CACHE_ENTRIES = 256  # probed costs kept per prober (each a few floats)
_PLAN_MEASURES = 3  # CUDA: chunks measured at their planned size, at most, per cost
_PLAN_TOLERANCE = 0.03  # a plan within 3% of a measured chunk is not measured again


class ChunkProber:
    """Measures and caches :class:`ChunkCost` per (model, input signature, autocast, ``get_rep_fn``)."""

    def __init__(self, probe_rows: Tuple[int, int] = (16, 48)) -> None:
        self.probe_rows = probe_rows
        # most recently used last; bounded, as dynamic padding brings a new input shape per length.
        # Each entry: the cost and whether the probe's backward runs by autograd.grad
        self._cache: "OrderedDict[Tuple, Tuple[ChunkCost, bool]]" = OrderedDict()

    def _key(self, model: nn.Module, x: Any, get_rep: Callable[[Any], Tensor], autocast: Optional[torch.dtype]) -> Tuple:
        # a batch smaller than the larger probe is probed at its own sizes, a cost that a later
        # larger batch must not inherit (its chunks would be sized from a few rows' line)
        return (_signature(model, x, autocast), min(self.probe_rows[1], batch_size(x)), callable_key(get_rep))

    def _store(self, key: Tuple, cost: ChunkCost, by_grad: bool) -> None:
        self._cache[key] = (cost, by_grad)
        self._cache.move_to_end(key)
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)

    def _measure_rows(self, model: nn.Module, x: Any, get_rep: Callable[[Any], Tensor], autocast_ctx: Callable[[], Any],
                      rows: Sequence[int], by_grad: Optional[bool], warm: bool) -> Tuple[List[Tuple[int, float, float, float]], bool]:
        """``(rows, peak, act, rep)`` of forward + backward of the first ``rows`` rows of ``x``, for each
        entry of ``rows``, with nothing the step can see changed; and whether the backward ran by
        ``autograd.grad`` (``by_grad=None``: tried first, else ``.backward()``). ``warm``: on CUDA the
        first size runs once unmeasured first."""
        params = [p for p in walk.parameters(model) if p.requires_grad]  # empty: a frozen model
        device = model_device(model, x)
        devices = model_cuda_devices(model)
        if device.type == "cuda":  # where the probe runs (a parameterless model: its inputs' device)
            index = device.index if device.index is not None else torch.cuda.current_device()
            devices = sorted(set(devices) | {index})
        with forked_rng(devices), buffers_restored([model]), buffers_reset_after([model]), torch.enable_grad(), \
                ddp_bypassed(model):
            def measure(c: int, grad: bool) -> Tuple[float, float, float]:
                # the chunk's tensors that require grad become leaves of the probe's own
                # copies (a few rows): a forward that writes its input in place must not touch the batch
                chunk = map_tensors(to_device(split_batch(x, c)[0], device),
                                    lambda t: t.detach().clone().requires_grad_(t.requires_grad))
                return _measure(model, chunk, get_rep, autocast_ctx, params, device, grad)

            def points_of(grad: bool) -> List[Tuple[int, float, float, float]]:
                # On CUDA, a first forward + backward also makes one-time allocations (library
                # workspaces, lazily built state) that the step does not repeat; counted in the
                # small probe they flatten the fitted slope and over-size the chunks (the likely
                # cause of 8% larger query chunks, 1265 vs 1171 rows, in an H200 process whose
                # first GPU work was the probe). So the small chunk runs once unmeasured first.
                if warm and device.type == "cuda":
                    measure(rows[0], grad)
                return [(c, *measure(c, grad)) for c in rows]

            if by_grad is not None:
                return points_of(by_grad), by_grad
            try:
                return points_of(True), True
            except RuntimeError as exc:  # reentrant checkpointing refuses autograd.grad
                if "use_reentrant" not in str(exc):
                    raise
                return points_of(False), False

    def cost(self, model: nn.Module, x: Any, get_rep: Callable[[Any], Tensor],
             autocast_ctx: Callable[[], Any], autocast: Optional[torch.dtype]) -> ChunkCost:
        b = batch_size(x)
        c1, c2 = min(self.probe_rows[0], b), min(self.probe_rows[1], b)
        key = self._key(model, x, get_rep, autocast)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key][0]
        if c1 == c2 and b > 2:  # a small batch: still two sizes, or the fixed part would be charged per row;
            c1 = max(b // 2, 2)  # not one row, which BatchNorm in training refuses (a batch of 2: one size)
        points, by_grad = self._measure_rows(model, x, get_rep, autocast_ctx, sorted({c1, c2}), None, warm=True)
        rep_per_row = points[-1][3] / points[-1][0]
        if len(points) == 1:  # a batch of one or two rows, measured whole: a smaller chunk is
            c, peak, act, _ = points[0]  # charged about that peak (a line of slope one byte through it)
            cost = ChunkCost(max(peak - c, 0.0), 1.0, 0.0, rep_per_row, act, probe_rows=c, probe_peak=peak,
                             probe_held=act)
        else:
            (ca, pa, aa, _), (cb, pb, ab, _) = points
            # the held graph: a two-point line (slope at least 0, fixed part at least 0)
            act_slope = max((ab - aa) / (cb - ca), 0.0)
            # The peak's slope is at least the held graph's: a large chunk peaks when its backward
            # starts, with every saved activation held, but a small probe may peak at the end of its
            # backward, when the parameters' gradients dominate and most activations are freed; a
            # line through two such points under-counts large chunks (H200, BERT-base queries with
            # gelu outputs recomputed in the backward, a session-13 experiment: 8.0 MiB/row fitted,
            # 9.2 measured between 1024 and 1600 rows, 9.7 held; a 16 GiB plan peaked at 16.6).
            # At least half the larger probe's bytes per row too: a guard against a flat fit
            # (allocator rounding). The fixed part then keeps the line above both probes, so a
            # chunk between them is not under-counted either (a model of large weights and small
            # activations: its fixed part is most of the peak).
            slope = max((pb - pa) / (cb - ca), act_slope, pb / cb * 0.5, 1.0)
            fixed = max(pa - slope * ca, pb - slope * cb, 0.0)
            cost = ChunkCost(fixed, slope, act_slope, rep_per_row, max(ab - act_slope * cb, 0.0), probe_rows=cb,
                             probe_peak=pb, probe_held=ab)
        self._store(key, cost, by_grad)
        return cost

    def plan(self, model: nn.Module, x: Any, get_rep: Callable[[Any], Tensor], autocast_ctx: Callable[[], Any],
             autocast: Optional[torch.dtype], cost: ChunkCost, budget: int) -> Tuple[int, ChunkCost]:
        """The largest chunk of ``x`` whose peak fits ``budget`` bytes, and the cost it was planned
        from. On CUDA a plan beyond the probes that is not within 3% of a chunk measured so far is
        measured itself (forward + backward of that many rows, as the probe: unseen by the step) and
        planned again from the refined cost, up to :data:`_PLAN_MEASURES` measurements per cost;
        the refined cost replaces ``cost`` in the cache (and one refined for an earlier input of
        the same model and shape is taken up)."""
        b = batch_size(x)
        if model_device(model, x).type != "cuda":  # the CPU estimate is linear in the saved bytes
            return cost.largest_chunk(budget, b), cost
        key = self._key(model, x, get_rep, autocast)
        by_grad = None
        if key in self._cache:
            cached, by_grad = self._cache[key]
            for point in cached.measured:  # (the same probes: their points refine either)
                if point[0] > cost.probe_rows:
                    cost = cost.with_point(*point)
        rows = cost.largest_chunk(budget, b)
        # (a plan within the probes' rows is on their line, which lies above them: not measured)
        while (rows > cost.probe_rows and len(cost.measured) < _PLAN_MEASURES
               and not cost.near_measured(rows, _PLAN_TOLERANCE)):
            [(c, peak, act, _)], by_grad = self._measure_rows(model, x, get_rep, autocast_ctx, [rows], by_grad, warm=False)
            cost = cost.with_point(c, peak, act)
            rows = cost.largest_chunk(budget, b)
            self._store(key, cost, by_grad)
        return rows, cost
