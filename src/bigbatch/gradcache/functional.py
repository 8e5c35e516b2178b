"""The public GradCache's functional API (``cached``, ``cat_input_tensor``, ``gather_input_tensor``), made exact.

For loops where the batch arrives in sub-batches (one per data-loader step) and only the
representations are kept until the loss of the whole accumulated batch is computed::

    @cached
    def encode(model, x):
        return model(**x).last_hidden_state[:, 0]

    @cat_input_tensor
    def loss_fn(q, p):                      # q, p: lists of per-sub-batch representations
        return bigbatch.clip_loss(q, p, scale)

    reps_q, reps_p, closures = [], [], []
    for step, (xq, xp) in enumerate(loader):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rq, fq = encode(query_encoder, xq)  # no graph: memory of one sub-batch at a time
            rp, fp = encode(passage_encoder, xp)
        reps_q.append(rq); reps_p.append(rp); closures += [(fq, rq), (fp, rp)]
        if (step + 1) % accumulation == 0:
            loss_fn(reps_q, reps_p).backward()  # fills rq.grad, rp.grad (and the loss's parameters)
            for f, r in closures:
                f(r)                            # re-run that sub-batch, back-propagate r.grad
            optimizer.step(); optimizer.zero_grad(); reps_q, reps_p, closures = [], [], []

Unlike the public package's ``grad_cache.functional`` (which restores the CPU random state only),
the closure re-runs the sub-batch under the CPU and CUDA random states (and Python's and NumPy's) and the autocast setting
captured at the first call, so dropout masks and precision match on a GPU and under AMP and the
update equals the full accumulated batch's exactly; the caller's random stream continues as if the
closure had not run. Buffers of modules passed to the function (BatchNorm statistics) are
updated by the first call only, not again by the closure, and the re-run reads them as the first
call did (``nn.utils.spectral_norm``'s vectors). Call signatures are the public package's. Under DDP, wrap all closures but the last in
``model.no_sync()`` to all-reduce once.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .buffers import BufferStates, buffers_restored, recording, restoring
from .chunking import differentiable, tensor_leaves
from .cast_scope import drop_gradless_casts
from .engine import Written, autocast_state, chunk_backward, compact, pass_one_in_grad_mode
from .lazy import LazyInits, skipping_inits
from .model_state import ModelState, param_versions
from .norms import fast_layer_norms, model_norms
from .rng import RngState, cuda_devices_of
from . import walk
from .wrappers import check_not_fsdp, check_not_parametrize_cached

Reps = Union[Tensor, Tuple[Tensor, ...]]


def _cuda_devices(args: Sequence[Any], kwargs: dict) -> List[int]:
    """CUDA devices whose generators the call may use: those of its tensors and modules, and every
    initialised device (the model may be reached through a closure rather than an argument)."""
    devices = cuda_devices_of(tensor_leaves(list(args)) + tensor_leaves(kwargs)
                              + [p for a in args if isinstance(a, torch.nn.Module) for p in walk.parameters(a)])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = sorted(set(devices) | set(range(torch.cuda.device_count())))
    return devices


def _as_tuple(reps: Any, name: str) -> Tuple[Tensor, ...]:
    out = (reps,) if isinstance(reps, Tensor) else tuple(reps) if isinstance(reps, (tuple, list)) else None
    if out is None or not out or not all(isinstance(t, Tensor) for t in out):
        raise TypeError(f"{name} must return a tensor or a tuple of tensors, got {type(reps).__name__}")
    return out


def _modules_in(x: Any, seen: Optional[set] = None) -> List[nn.Module]:
    """The modules among the call's arguments, also inside lists, tuples and dicts (each once)."""
    seen = set() if seen is None else seen
    if isinstance(x, nn.Module):
        if id(x) in seen:
            return []
        seen.add(id(x))
        return [x]
    if isinstance(x, Mapping):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [m for v in x for m in _modules_in(v, seen)]
    return []


def cached(func: Callable[..., Reps]) -> Callable[..., Tuple[Any, ...]]:
    """Decorate ``func(*args, **kwargs) -> representation(s)``; the result returns
    ``(rep_1, ..., rep_n, closure)`` as the public package does (``rep, closure`` for one): the reps
    are detached leaves that require grad (computed without a graph) and ``closure(reps)`` (a
    tensor or the tuple of them), called after the loss's backward filled their ``.grad``, re-runs
    ``func`` under the first call's random and autocast state and back-propagates those gradients
    into the parameters (accumulating into ``.grad``)."""

    @functools.wraps(func)
    @walk.walked
    def cache_func(*args: Any, **kwargs: Any):
        modules = _modules_in((args, kwargs))
        check_not_parametrize_cached(f"cached({func.__name__})", modules)
        for m in modules:
            check_not_fsdp(m)
        rng = RngState(_cuda_devices(args, kwargs))
        amp = autocast_state()
        # modules passed to func: the re-run starts from the buffers this call saw, and leaves them
        # as this call left them (BatchNorm statistics updated once)
        states = BufferStates(modules)
        # grad mode off, as the public package; on (graph dropped) where a module's forward would
        # take another path without it or ``func`` is compiled (engine.pass_one_in_grad_mode), so
        # the re-run matches
        written = Written((list(args), kwargs))
        versions = [param_versions(m) for m in modules]
        with recording(states, modules) as box, torch.set_grad_enabled(pass_one_in_grad_mode(modules, func)), \
                LazyInits(modules).recording(rng.devices) as lazy_after:
            out = func(*args, **kwargs)
        written.check(rerun=True)
        record = box["record"]
        # modes and parameter versions, as this call left them (those it modified itself not checked)
        model_states = [ModelState(m, v) for m, v in zip(modules, versions)]
        first = _as_tuple(out, func.__name__)
        # compact: a view such as out[:, 0] would keep the sub-batch's whole output alive
        leaves = tuple(compact(t).requires_grad_(differentiable(t)) for t in first)
        spent = [False]

        @walk.walked
        def forward_backward(cache_reps: Reps) -> None:
            reps_in = _as_tuple(cache_reps, "the closure's argument")
            if len(reps_in) != len(leaves):
                raise ValueError(f"the closure of {func.__name__} got {len(reps_in)} representation(s); pass all "
                                 f"{len(leaves)} that the decorated call returned (a tensor or a tuple, in order)")
            if spent[0]:
                raise RuntimeError(f"the closure of {func.__name__} ran twice: its sub-batch is already back-propagated")
            if any(r is not leaf for r, leaf in zip(reps_in, leaves)):
                raise ValueError(f"the closure of {func.__name__} got representation(s) its call did not return "
                                 "(another sub-batch's?): pass the tensors the decorated call returned with it")
            grads = [r.grad for r in reps_in]
            if all(g is None for g in grads):
                raise RuntimeError(
                    f"the representations passed to the closure of {func.__name__} have no .grad: call it after "
                    "the loss's backward, with the tensors the decorated call returned"
                )
            check_not_parametrize_cached(f"the closure of {func.__name__}", modules)
            written.check_before_rerun()
            for state in model_states:
                state.check_params(f"the cached call of {func.__name__}")
            # the first call's modes, buffers, random and autocast state; then its gradients back
            with contextlib.ExitStack() as stack:
                for state in model_states:
                    stack.enter_context(state.modes_restored())
                stack.enter_context(buffers_restored(modules))
                stack.enter_context(restoring(states, record, modules))
                # the one-pass LayerNorm backward for the re-run's forward and backward (engine.py)
                stack.enter_context(fast_layer_norms([n for m in modules for n in model_norms(m)]))
                drop_gradless_casts()  # (an old torch: a caller's region may hold the first call's casts)
                with torch.enable_grad(), rng.replay(), _AutocastReplay(amp), skipping_inits(modules, lazy_after):
                    again = _as_tuple(func(*args, **kwargs), func.__name__)
                pairs = [(t, g) for t, g in zip(again, grads) if g is not None and t.requires_grad]
                if pairs:
                    chunk_backward([t for t, _ in pairs], [g.to(t.dtype) for t, g in pairs])
            spent[0] = True

        return (*leaves, forward_backward)  # as the public package: rep(s) first, the closure last

    return cache_func


class _AutocastReplay:
    """Re-enter the captured autocast contexts (the backward runs outside them)."""

    def __init__(self, active: Sequence[Tuple[str, torch.dtype]]) -> None:
        self.contexts = [torch.autocast(device_type=d, dtype=t) for d, t in active]
        self.disable = [torch.autocast(device_type=d, enabled=False) for d in ("cuda", "cpu")
                        if d not in {a for a, _ in active} and torch.is_autocast_enabled(d)]

    def __enter__(self) -> None:
        for c in self.contexts + self.disable:
            c.__enter__()

    def __exit__(self, *exc: Any) -> bool:
        for c in reversed(self.contexts + self.disable):
            c.__exit__(*exc)
        return False


def cat_input_tensor(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a loss so that every argument that is a list of tensors is concatenated along
    dimension 0 first (the per-sub-batch representations of ``cached`` calls); tuples pass as they are."""

    @functools.wraps(func)
    def cat_f(*args: Any, **kwargs: Any) -> Any:
        def cat(x: Any) -> Any:
            if isinstance(x, list) and x and all(isinstance(t, Tensor) for t in x):  # lists only, as the public package
                return torch.cat(x, dim=0)
            return x

        return func(*[cat(a) for a in args], **{k: cat(v) for k, v in kwargs.items()})

    return cat_f


_GATHER_DIMS = 8  # dimensions a gathered tensor may have (each one's size is compared across ranks)


def _dim_text(v: float) -> str:
    return "none" if v < 0 else str(int(v))


def _gathered(t: Any, axis: int) -> Any:
    """``t`` all-gathered from every rank of the default group and concatenated on ``axis`` (ranks
    may hold different sizes there); this rank's part is ``t`` itself, so only it carries a gradient."""
    if not isinstance(t, Tensor):
        return t
    import torch.distributed as dist

    from ..distributed.gather import all_gather_rows
    from ..distributed.ring import Ring, agree, dtype_code

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("gather_input_tensor gathers from the default process group: torch.distributed is not "
                         "initialised (call init_process_group first)")
    ring = Ring.of(dist.group.WORLD)
    # every rank checks its tensor and exchanges its shape and dtype before any data moves: a
    # mismatch (another width, dtype or rank of tensor) is one ValueError on every rank, never bytes
    # read as another shape or a crashed peer
    problem = None
    if t.dim() == 0:
        problem = ("a 0-d tensor cannot be gathered (a scale or temperature: keep it out of the gathered "
                   "arguments, or pass a python number)")
    elif not -t.dim() <= axis < t.dim():
        problem = f"axis {axis} is out of range for a tensor of shape {tuple(t.shape)}"
    elif t.dim() > _GATHER_DIMS:
        problem = f"tensors of more than {_GATHER_DIMS} dimensions are not gathered, got {t.dim()}"
    shape = list(t.shape) if problem is None else []
    rows = shape.pop(axis) if shape else 0
    fields = {"rows": rows, "ndim": t.dim(), "dtype": dtype_code(t.dtype)}
    fields.update({f"dim{i}": shape[i] if i < len(shape) else -1 for i in range(_GATHER_DIMS - 1)})
    # named by this rank's dimension index (the gathered axis left out of the exchanged sizes)
    others = [d for d in range(t.dim()) if d != axis % t.dim()] if problem is None else []
    shown = {f"dim{i}": (f"the size of dimension {others[i]}" if i < len(others) else
                         f"size {i} beside the gathered axis", _dim_text) for i in range(_GATHER_DIMS - 1)}
    table = agree(ring, t.device, fields, same=["ndim", "dtype"] + [f"dim{i}" for i in range(_GATHER_DIMS - 1)],
                  local_error=problem, shown=shown, what="gather_input_tensor")
    sizes = [int(n) for n in table["rows"]]
    parts = [p.movedim(0, axis) for p in all_gather_rows(t.movedim(axis, 0), ring, sizes)]
    parts[ring.rank] = t
    return torch.cat(parts, dim=axis)


def gather_input_tensor(func: Callable[..., Any], axis: int = 0) -> Callable[..., Any]:
    """Decorate a loss so that every tensor argument is all-gathered from the default process group
    and concatenated on ``axis`` first, as the public package's decorator of that name (uneven
    sizes across ranks allowed). Each rank's loss then sees the global batch, but only its own
    rows carry a gradient, so DDP's averaging yields 1/world_size of the encoders' full-batch
    gradient (multiply the loss by the world size for the exact one). Not so for parameters of the
    loss itself (a logit scale, a bias): every rank's loss sees the whole batch, so their gradient
    is already the full batch's on each rank, and the multiplied loss makes it world_size times too
    large (divide their ``.grad`` by the world size, without an all-reduce). bigbatch's own losses
    with ``group=`` need no gather: their ring gives every gradient exact in O(B) memory."""

    @functools.wraps(func)
    def gathered_f(*args: Any, **kwargs: Any) -> Any:
        return func(*[_gathered(a, axis) for a in args], **{k: _gathered(v, axis) for k, v in kwargs.items()})

    return gathered_f
