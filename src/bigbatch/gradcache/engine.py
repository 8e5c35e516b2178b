"""The two passes of gradient caching over a list of chunk units.

Pass 1 (``encode``): every chunk runs without a graph; its random state is captured first, and
the buffers its forward reads are recorded (``buffers.py``) so that its re-run reads the same.
Chunks flagged ``keep`` (a suffix of the pass, chosen to fit the memory budget) run *with* a
graph that is kept, so pass 2 only back-propagates them: it saves their second forward.

Pass 2 (``backprop``): kept chunks are back-propagated first (freeing their graphs), then, model
by model (in order of first use), every other chunk is re-run under its replayed random state and autocast setting and
back-propagated with its slice of the cached representation gradient. Parameter gradients
accumulate in ``.grad`` (in a few fused launches per chunk: ``accumulate.py``); the sum over chunks is exactly the full-batch gradient because the loss
gradient w.r.t. each representation row was computed on the whole batch.

DDP (``ddp_sync="last_chunk"``): every forward that builds a graph runs under ``no_sync``
except the model's last re-run chunk, whose backward all-reduces the accumulated gradients
once. A model holding a DDP module (itself or inside a wrapper) keeps no pass-1 graph: DDP
rebuilds its buckets, a collective, in its first forward with grad after its first synced
backward; a kept chunk's forward runs with grad in pass 1, before the loss's collectives, so
ranks that keep differently (uneven batches, other chunk sizes) would issue their collectives
in different orders and hang. Memory: one chunk's activations, plus kept graphs.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .accumulate import Accumulations, accumulating
from .buffers import BufferStates, buffers_restored, recording, restoring
from .cast_scope import CastScope, drop_gradless_casts
from .chunking import call_model, check_not_detached, model_device, staged, tensor_leaves
from .lazy import LazyInits, skipping_inits
from .model_state import ModelState, param_versions
from .norms import fast_layer_norms, model_norms
from .rng import RngState, cuda_devices_of, model_cuda_devices
from . import walk
from .wrappers import agree_no_plain_forward_pending, check_same_sync_count, own_ddp_forwards, sync_context


@dataclass
class Unit:
    """One chunk of one input: where it came from, and what pass 1 left for pass 2."""

    input_index: int
    model: nn.Module
    chunk: Any
    rows: Optional[int]  # None: a custom chunk type, set from its representation in pass 1
    keep: bool = False
    rerun: bool = True  # False: nothing back-propagates it (a frozen tower; a forward under no_grad)
    # re-run for a trainable tensor its model does not register (EngineOptions.detect_hidden): such a
    # tensor may carry a graph of its own (merged weights W + A @ B built once per step), which every
    # chunk's backward crosses, so those backwards retain the graph
    hidden: bool = False
    rng: Optional[RngState] = None
    kept_rep: Optional[Tensor] = None
    buffers: Optional[Tuple[BufferStates, Dict[int, Tensor]]] = None  # the buffers its pass-1 forward saw
    written: Optional["Written"] = None  # its input's version counters, checked again before the re-run
    # the model's DDP modules (wrappers.ddp_modules, found once per model and step: a walk over
    # every submodule, too slow to repeat per chunk on a host-bound step)
    ddps: Sequence[nn.Module] = ()
    # lazy modules its pass-1 forward initialised: id -> random state right after (lazy.py)
    lazy_after: Optional[Dict[int, RngState]] = None
    # its model's modes and parameter versions at the end of pass 1 (model_state.py)
    state: Optional[ModelState] = None


@dataclass
class EngineOptions:
    get_rep: Callable[[Any], Tensor]
    autocast_dtype: Optional[torch.dtype] = None
    offload_inputs: bool = False
    offload_reps: bool = False
    ddp_sync: str = "last_chunk"
    # tensors each chunk's backward accumulates into (backward's ``inputs=``); None: every leaf
    grad_targets: Optional[List[Tensor]] = None
    # with autocast_dtype None: False runs both passes with autocast off (cached_encode's forward ran
    # outside autocast, its backward may run inside); True leaves the caller's state (GradCache)
    inherit_autocast: bool = True
    # cached_encode (re-run inside the caller's backward): refuse, on every rank, while a plain synced
    # forward of the same DDP module waits for its reduction (wrappers.agree_no_plain_forward_pending)
    check_plain_ddp: bool = False
    # pass 1 of a unit not to be re-run runs in grad mode (free: a frozen model records nothing) and
    # is flagged for a re-run if its representation requires grad all the same -- a trainable tensor
    # the model does not register (a projection in get_rep_fn, torch.func.functional_call weights)
    detect_hidden: bool = True


def autocast_state() -> List[Tuple[str, torch.dtype]]:
    """The (device type, dtype) of every autocast context active now."""
    active = []
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            active.append((device_type, torch.get_autocast_dtype(device_type)))
    return active


def _autocast(device: torch.device, dtype: Optional[torch.dtype], inherit: bool = True) -> Callable[[], Any]:
    if dtype is None:
        return contextlib.nullcontext if inherit else (lambda: torch.autocast(device_type=device.type, enabled=False))
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def _no_autocast(device: torch.device, dtype: Optional[torch.dtype], inherit: bool = True) -> Callable[[], Any]:
    """Autocast switched off inside a pass-wide autocast context (for a chunk's backward). A nested
    context: leaving it keeps the outer context's weight-cast cache."""
    if dtype is None and inherit:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, enabled=False)


def _rep(opts: EngineOptions, model: nn.Module, chunk: Any, rows: Optional[int], graph: bool = True) -> Tensor:
    """The chunk's representation; ``graph``: one whose gradient is needed (a kept or re-run chunk)."""
    out = call_model(model, chunk)
    rep = opts.get_rep(out)
    if not isinstance(rep, Tensor):
        raise TypeError(f"get_rep_fn must return a tensor, got {type(rep).__name__}; pass get_rep_fn=...")
    if rows is None and rep.dim() > 0:
        rows = rep.shape[0]
    if rep.dim() == 0 or rep.shape[0] != rows:
        raise ValueError(f"the representation of a {rows}-row chunk has shape {tuple(rep.shape)}; "
                         "dimension 0 must be the batch")
    # a chunk whose gradient is needed: a representation without grad is an error when the model's
    # output had one (get_rep_fn detached it); an output without any means this forward used no
    # trainable tensor (a wrapper calling only a frozen tower of a shared model): no gradient to send
    if graph and torch.is_grad_enabled():
        check_not_detached(rep, out)
    return rep


def compact(rep: Tensor) -> Tensor:
    """``rep`` detached, copied when it is a view into a larger tensor. A representation such as
    ``out.last_hidden_state[:, 0]`` would otherwise keep the whole (rows, seq, hidden) output of
    every chunk alive until the step ends: B * seq * hidden floats, which grows with the batch."""
    rep = rep.detach()
    if rep.untyped_storage().nbytes() > rep.numel() * rep.element_size():
        rep = rep.clone(memory_format=torch.contiguous_format)
    return rep


def distinct_models(models: Sequence[nn.Module]) -> List[nn.Module]:
    """``models`` with each model once (by identity), in order of first appearance."""
    out: Dict[int, nn.Module] = {}
    for m in models:
        out.setdefault(id(m), m)
    return list(out.values())


def finalize_plan(units: Sequence[Unit]) -> None:
    """Apply the DDP rule above to the ``keep`` flags (in place): no kept graph in a DDP model."""
    for u in units:
        if u.ddps:
            u.keep = False


def grad_mode_dependent(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes another path when grad mode is off, so that its pass-1
    forward must run in grad mode, as its re-run will:

    * an eval-mode ``nn.MultiheadAttention`` (so also ``nn.TransformerEncoder(Layer)``) takes
      PyTorch's inference fast path, whose nested tensors return zeros at padded positions where
      the path taken with a graph computes values;
    * a ``torch.compile``'d module (``torch.compile(model)``, ``module.compile()``, a compiled
      ``forward``, anywhere in the model) runs another graph without grad: the inference graph
      fuses differently, so its output differs from the training graph's in the last bits, and a
      sharp loss amplifies that (the benchmark's BERT check on an H200: 3.4% off the full batch's
      gradient). In grad mode, pass 1 and the re-run run one graph under one random state:
      bitwise equal."""
    fastpath = getattr(getattr(torch.backends, "mha", None), "get_fastpath_enabled", lambda: True)()
    mhas = walk.memoised("mha", model, lambda mod: [m for m in walk.submodules(mod) if isinstance(m, nn.MultiheadAttention)])
    return any(fastpath and not m.training for m in mhas) or has_compiled_part(model)


def has_compiled_part(model: nn.Module) -> bool:
    """Whether a module of ``model`` is ``torch.compile`` d: an ``OptimizedModule``, one that
    ``module.compile()`` was called on, or one whose ``forward`` (set on it, or its class's) is
    compiled. Per step; the modules' classes and ``__dict__`` s are memoised with the structure
    (carried across steps, ``walk.py``), what they hold is read each time (C-level scans)."""
    classes = walk.memoised("classes", model, lambda mod: frozenset(map(type, walk.submodules(mod))))
    if any(map(_class_compiled, classes)):
        return True
    dicts = walk.memoised("dicts", model, lambda mod: tuple(map(vars, walk.submodules(mod))))
    if any(map(_COMPILED_IMPL, dicts)):
        return True
    return any(compiled_callable(d["forward"]) for d in filter(_HAS_FORWARD, dicts))


_COMPILED_IMPL = operator.methodcaller("get", "_compiled_call_impl")  # set by module.compile()
_HAS_FORWARD = operator.methodcaller("__contains__", "forward")  # a forward set on the instance


def _class_compiled(cls: type) -> bool:
    optimized = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "OptimizedModule", ())
    return issubclass(cls, optimized) or compiled_callable(getattr(cls, "forward", None))  # a decorated forward


def pass_one_in_grad_mode(modules: Iterable[nn.Module], fn: Any = None) -> bool:
    """Whether a pass-1 forward through ``modules``, with ``fn`` applied (a ``get_rep_fn``, the
    function given to ``cached``), must run in grad mode (graph dropped) to take the re-run's path."""
    return compiled_callable(fn) or any(map(grad_mode_dependent, modules))


def compiled_callable(fn: Any) -> bool:
    """Whether ``fn`` is a function (or bound method) wrapped by ``torch.compile``: it too runs
    another graph without grad (a compiled ``get_rep_fn``, the function given to ``cached``). A
    compiled function called *inside* an uncompiled forward cannot be seen from outside."""
    return getattr(fn, "_torchdynamo_orig_callable", None) is not None


class Written:
    """Version counters of a chunk's input tensors around its first forward: a forward that writes
    its input in place (``x.div_(255)``) would leave its re-run a different input, so it is an
    error, not a silently wrong gradient. (An offloaded chunk is re-staged from the untouched
    source, so writes into its device copy are harmless and not seen here.)"""

    def __init__(self, chunk: Any) -> None:
        # inference tensors have no version counter (and cannot be written outside inference mode)
        self.tensors = [t for t in tensor_leaves(chunk) if not t.is_inference()]
        self.versions = [t._version for t in self.tensors]

    def _changed(self) -> bool:
        return any(t._version != v for t, v in zip(self.tensors, self.versions))

    def check(self, rerun: bool) -> None:
        if rerun and self._changed():
            raise RuntimeError(
                "the encoder's forward modified its input in place (e.g. x.div_(255)); gradient caching "
                "re-runs each chunk on its input, which would no longer be the same: use out-of-place "
                "ops on the input (x = x / 255) or clone it inside forward")

    def check_before_rerun(self) -> None:
        """The input must still be what the first forward saw (a plain graph's saved tensors raise
        the same way when modified before the backward)."""
        if self._changed():
            raise RuntimeError(
                "an input of the encoder was modified in place after its cached forward and before the "
                "backward (e.g. ids[:, 0] = mask_id for another pass); the re-run would encode the new "
                "values: modify a clone of the input instead")


def _first_run(u: Unit, chunk: Any, opts: EngineOptions, devices: List[int], mirror: bool,
               lazy: LazyInits) -> Tensor:
    """Pass 1 of one chunk: with a kept graph, or without a graph under a captured random state
    (of ``devices``, the model's CUDA devices, and those of the chunk's tensors). Returns the
    detached (compact) representation; sets ``u.rows`` for a custom chunk type."""
    if u.keep:
        drop_gradless_casts()  # (an old torch: no-grad chunks' casts would reach this graph without theirs)
        with sync_context(u.ddps, sync=False)(), torch.enable_grad():
            rep = _rep(opts, u.model, chunk, u.rows)
        u.kept_rep = rep
        rep = compact(rep)
    else:
        u.rng = RngState(sorted(set(devices) | set(cuda_devices_of(tensor_leaves(chunk)))))
        mirror = mirror and u.rerun
        detect = opts.detect_hidden and not u.rerun
        if mirror or detect:
            drop_gradless_casts()
        # a mirrored forward builds a graph, dropped as soon as the representation is detached
        # (one chunk's activations, which the chunk size allows for its re-run anyway); under
        # no_sync, so that DDP neither arms its reducer nor re-broadcasts buffers before the next chunk
        with sync_context(u.ddps, sync=not (mirror or detect))(), torch.set_grad_enabled(mirror or detect), \
                lazy.recording(u.rng.devices) as inits:
            rep = _rep(opts, u.model, chunk, u.rows, graph=False)
        u.lazy_after = inits or None
        if detect and rep.requires_grad:
            u.rerun = u.hidden = True
        rep = compact(rep)
    if u.rows is None:  # a custom chunk: its rows are its representation's
        u.rows = rep.shape[0]
    return rep


@contextlib.contextmanager
def _one_row_chunk_hint(u: Unit, n_chunks: int) -> Iterator[None]:
    """BatchNorm in training refuses a one-row chunk of 2-D features ("Expected more than 1 value
    per channel"), which the whole batch would pass: say that the chunking made it."""
    try:
        yield
    except ValueError as exc:
        if u.rows == 1 and n_chunks > 1 and "more than 1 value per channel" in str(exc):
            raise ValueError(
                f"a one-row chunk of inputs[{u.input_index}] failed BatchNorm in training mode ({exc}): the "
                "chunk size leaves one row over (B = k * chunk + 1); choose one that does not, or pass "
                "memory_budget= instead, whose plans avoid one-row chunks") from exc
        raise


def _amp_for(scope: Optional[CastScope], model: nn.Module, device: torch.device, amp: Callable[[], Any]) -> Any:
    """``amp()``, or the scope's context for ``model`` (left open on exit)."""
    return amp() if scope is None else scope.around(model, device, amp)


def encode(units: Sequence[Unit], opts: EngineOptions, n_inputs: int, scope: Optional[CastScope] = None) -> List[Tensor]:
    """Pass 1. Returns one detached (B_i, ...) representation tensor per input, on the model's device.
    ``scope``: the autocast contexts are the scope's, and the last one is left open."""
    per_input: List[List[Tensor]] = [[] for _ in range(n_inputs)]
    models = distinct_models([u.model for u in units])
    states = BufferStates(models)
    versions = {id(m): param_versions(m) for m in models}
    for i in range(n_inputs):
        mine = [u for u in units if u.input_index == i]
        if not mine:
            continue
        device = model_device(mine[0].model, mine[0].chunk)
        amp = _autocast(device, opts.autocast_dtype, opts.inherit_autocast)
        devices = model_cuda_devices(mine[0].model)
        mirror = pass_one_in_grad_mode([mine[0].model], opts.get_rep)
        lazy = LazyInits([mine[0].model])  # empty once materialised (after the first step)
        # One autocast context for all chunks of this input (with a scope: of consecutive inputs of
        # one model, and on into pass 2): autocast casts each fp32 weight to half once per context,
        # so the chunks share one cast (one ~2-bytes-per-parameter copy kept for the pass) instead
        # of re-casting every weight per chunk. With a kept chunk, the copies
        # to the model's device are made in grad mode (cached_encode runs pass 1 under no_grad): a
        # kept graph must reach back through its chunk's copy to inputs that require grad (each
        # chunk's forward sets its own grad mode).
        copies_in_graph = torch.enable_grad() if any(u.keep for u in mine) else contextlib.nullcontext()
        with _amp_for(scope, mine[0].model, device, amp), copies_in_graph, fast_layer_norms(model_norms(mine[0].model)):
            for u, chunk in zip(mine, staged([u.chunk for u in mine], device, opts.offload_inputs)):
                written = Written(u.chunk)
                with recording(states, [u.model]) as record, _one_row_chunk_hint(u, len(mine)):
                    rep = _first_run(u, chunk, opts, devices, mirror, lazy)
                written.check(u.rerun and not u.keep)
                if not u.keep:
                    u.buffers = (states, record["record"])
                    u.written = written
                per_input[i].append(rep.to("cpu", non_blocking=False) if opts.offload_reps else rep)
    model_states = {id(m): ModelState(m, versions[id(m)]) for m in models}
    for u in units:
        u.state = model_states[id(u.model)]
    drop_gradless_casts()  # (an old torch: what runs next in grad mode must not reuse pass 1's casts)
    out = []
    for i, reps in enumerate(per_input):
        if not reps:
            raise ValueError(f"input {i} produced no chunks")
        rep = torch.cat(reps, dim=0) if len(reps) > 1 else reps[0]
        if opts.offload_reps:
            first = next(u for u in units if u.input_index == i)
            rep = rep.to(model_device(first.model, first.chunk))
        out.append(rep)
    return out


def grad_slices(units: Sequence[Unit], grads: Sequence[Optional[Tensor]], opts: EngineOptions) -> Dict[int, Tensor]:
    """Unit index -> its rows of the cached gradient (on the CPU with ``offload_reps``); units whose
    input got no gradient are absent."""
    slices: Dict[int, Tensor] = {}
    offsets = [0] * len(grads)
    for k, u in enumerate(units):
        g = grads[u.input_index]
        if g is not None:
            g = g[offsets[u.input_index] : offsets[u.input_index] + u.rows]
            slices[k] = g.to("cpu") if opts.offload_reps else g
        offsets[u.input_index] += u.rows
    return slices


_FREED = "backward through the graph a second time"  # PyTorch's error for a graph already freed


def chunk_backward(tensors: Any, grads: Any, inputs: Optional[List[Tensor]] = None, retain: bool = False) -> None:
    """``torch.autograd.backward`` of one chunk, with a clear error for a graph found freed."""
    try:
        torch.autograd.backward(tensors, grads, inputs=inputs, retain_graph=retain)
    except RuntimeError as exc:
        if _FREED not in str(exc):
            raise
        raise RuntimeError(
            "gradient caching: a chunk's backward reached a graph that an earlier backward (another chunk's, or "
            "the loss's) had already freed. The encoder's forward uses a tensor that requires grad and was computed "
            "outside it, with a graph of its own (e.g. merged weights W + A @ B built once per step): each chunk "
            "back-propagates on its own, so compute such tensors inside the encoder's forward. (A model that "
            "registers no trainable parameter and is fed no input that requires grad is handled: the graph is "
            "retained per chunk.)") from exc


def _send(rep: Tensor, grad: Tensor, opts: EngineOptions, retain: bool = False) -> int:
    """Back-propagate a chunk's slice of the cached gradient; returns 1 if the chunk built a graph,
    0 if its forward used no tensor that requires grad (nothing to send). ``retain``: keep the
    graph's buffers (a hidden trainable tensor's own graph, crossed by every chunk: ``Unit.hidden``)."""
    if not rep.requires_grad:
        return 0
    targets = opts.grad_targets
    if targets is not None and not targets:
        return 1  # a graph, of which nothing is asked for
    chunk_backward(rep, grad.to(rep.device, rep.dtype), targets, retain)
    return 1


def backprop_kept(units: Sequence[Unit], slices: Dict[int, Tensor], opts: EngineOptions,
                  scope: Optional[CastScope], accs: Accumulations) -> Tuple[int, int]:
    """Back-propagate (and free) every kept graph. Runs before any chunk is re-run, so kept
    activations never coexist with a re-run chunk's forward + backward. Returns (chunks with a
    gradient, of those with a graph). Autocast is off for the backward inside a scope's context."""
    sent = graphs = 0
    no_amp = scope.suspended if scope is not None else contextlib.nullcontext
    for k, u in enumerate(units):
        if not u.keep:
            continue
        rep, u.kept_rep = u.kept_rep, None
        if k in slices:
            sent += 1
            with sync_context(u.ddps, sync=False)(), accs.of(u.model).chunk(), \
                    fast_layer_norms(model_norms(u.model)), no_amp():
                graphs += _send(rep, slices[k], opts)
        del rep
    return sent, graphs


def rerun_groups(units: Sequence[Unit], slices: Dict[int, Tensor], first: Optional[nn.Module] = None) -> List[List[int]]:
    """The units to re-run, grouped by model in order of first use; ``first``'s group (the model
    whose autocast context is open) first."""
    order: Dict[int, List[int]] = {}
    for k, u in enumerate(units):
        if not u.keep and k in slices:
            order.setdefault(id(u.model), []).append(k)
    groups = list(order.values())
    if first is not None:
        groups.sort(key=lambda g: units[g[0]].model is not first)  # stable: the others keep their order
    return groups


def backprop(units: Sequence[Unit], grads: Sequence[Optional[Tensor]], opts: EngineOptions,
             scope: Optional[CastScope] = None) -> Tuple[int, int]:
    """Pass 2. ``grads[i]`` is d(loss)/d(representation of input i), (B_i, ...), or ``None`` (no
    gradient). Returns (chunks that received a gradient, of those whose forward built a graph: a
    chunk without one used no trainable tensor and sends nothing). ``scope``: the open autocast
    context's model re-runs first, inside it."""
    for state in {id(u.state): u.state for u in units if u.state is not None}.values():
        state.check_params("the cached forward")
    slices = grad_slices(units, grads, opts)
    drop_gradless_casts()  # (an old torch: a caller's region may hold pass 1's graphless casts)
    # one fused gradient accumulation per model across its kept chunks and re-runs (accumulate.py)
    with accumulating() as accs:
        sent, graphs = backprop_kept(units, slices, opts, scope, accs)
        # Buffers: each re-run starts from what its pass-1 forward saw (BufferStates); afterwards all
        # are put back as pass 1 left them (BatchNorm statistics are not updated a second time).
        with buffers_restored(distinct_models([u.model for u in units])):
            for rerun in rerun_groups(units, slices, scope.model if scope is not None else None):
                graphs += _rerun_model(units, rerun, slices, opts, scope, accs)
                sent += len(rerun)
    return sent, graphs


def _rerun_model(units: Sequence[Unit], rerun: List[int], slices: Dict[int, Tensor], opts: EngineOptions,
                 scope: Optional[CastScope], accs: Accumulations) -> int:
    """Re-run and back-propagate the chunks ``rerun`` (indices into ``units``) of one model;
    returns how many built a graph."""
    graphs = 0
    model = units[rerun[0]].model
    device = model_device(model, units[rerun[0]].chunk)
    amp = _autocast(device, opts.autocast_dtype, opts.inherit_autocast)
    no_amp = _no_autocast(device, opts.autocast_dtype, opts.inherit_autocast)
    acc = accs.of(model)
    if opts.ddp_sync == "every_chunk" and units[rerun[0]].ddps:
        check_same_sync_count(units[rerun[0]].ddps, len(rerun))
    # As in pass 1, one autocast context (one weight cast) for every re-run chunk of the model;
    # each chunk's backward runs with autocast off, as it would outside the context. The modules
    # in their pass-1 modes (a model.eval() before cached_encode's backward changes nothing).
    modes = units[rerun[0]].state.modes_restored() if units[rerun[0]].state is not None else contextlib.nullcontext()
    agreed = False
    with _amp_for(scope, model, device, amp), modes, fast_layer_norms(model_norms(model)):
        for n, (k, chunk) in enumerate(zip(rerun, staged([units[k].chunk for k in rerun], device, opts.offload_inputs))):
            u = units[k]
            sync = n == len(rerun) - 1 or opts.ddp_sync == "every_chunk"
            if u.written is not None:
                u.written.check_before_rerun()
            if u.state is not None:  # (a hook may have stepped an optimizer in an earlier backward)
                u.state.check_params("the cached forward", during_backward=True)
            with sync_context(u.ddps, sync=sync)(), own_ddp_forwards():
                states, record = u.buffers
                with restoring(states, record, [u.model]), torch.enable_grad(), u.rng.replay(), \
                        skipping_inits([u.model], u.lazy_after):
                    rep = _rep(opts, u.model, chunk, u.rows)
                if sync and opts.check_plain_ddp and not agreed:
                    # once, between the first synced re-run's forward and its backward: after the
                    # forward, where DDP may rebuild its buckets (a collective that ranks with other
                    # chunk counts reach in other chunks), before the backward's all-reduce
                    agree_no_plain_forward_pending(u.ddps)
                    agreed = True
                with no_amp(), acc.chunk():
                    graphs += _send(rep, slices[k], opts, retain=u.hidden)
            del rep
    return graphs
