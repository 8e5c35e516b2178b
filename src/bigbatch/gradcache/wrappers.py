"""What GradCache must know about distributed wrappers: DDP (supported, one sync per step) and
FSDP (refused, with the reason)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, ContextManager, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakTensorKeyDictionary

from . import walk
from .graph import graph_leaves

DDP_SYNC_MODES = ("last_chunk", "every_chunk")

_FSDP_WHY = (
    "GradCache does not support FSDP-wrapped modules ({name}). Gradient caching runs every chunk's "
    "forward twice and its backward once per chunk; under FSDP each re-run backward reduce-scatters "
    "and reshards the gradients per chunk, and accumulating them without sync (FSDP no_sync / "
    "set_requires_gradient_sync(False)) keeps unsharded gradients for the whole model, which is "
    "neither the memory FSDP promises nor a path whose gradients bigbatch has verified against a "
    "full batch. Rather than risk silently wrong gradients, wrap the encoder in "
    "torch.nn.parallel.DistributedDataParallel (one all-reduce per cached step) or use "
    "gradient checkpointing inside the FSDP model without GradCache."
)


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel)


def ddp_modules(model: nn.Module) -> Sequence[DistributedDataParallel]:
    """The DDP modules in ``model``: itself, or inside a wrapper (a per-input module around a
    shared DDP model)."""
    return walk.memoised("ddp", model, lambda mod: [m for m in walk.submodules(mod) if isinstance(m, DistributedDataParallel)])


@contextlib.contextmanager
def ddp_bypassed(model: nn.Module) -> Iterator[None]:
    """Every DDP module in ``model`` (itself, or inside a per-input wrapper) forwards straight to its
    wrapped module: no collective. For the memory probe, which runs on some ranks only, or a
    different number of times per rank (its row counts follow the local batch, its cache the
    local input shapes): a DDP forward there (bucket rebuild, buffer broadcast) would pair with
    another rank's step collectives and hang or exchange mismatched data."""
    ddps = ddp_modules(model)
    own = [d.__dict__.get("forward") for d in ddps]  # a forward the user set on the instance: put back after
    for d in ddps:
        d.forward = d.module.__call__  # an instance attribute shadows DistributedDataParallel.forward
    try:
        with own_ddp_forwards():
            yield
    finally:
        for d, f in zip(ddps, own):
            if f is None:
                del d.forward
            else:
                d.forward = f


# -- plain forwards of a DDP module that cached_encode also re-runs ------------------------------
# DDP's reducer serves one synced forward per backward. A plain synced forward (grad on, sync on)
# of a DDP module whose reduction has not run is re-armed away by a cached_encode re-run's synced
# forward: its gradients are then never all-reduced, with no error from DDP (whose state does not
# show a pending reduction). So the forwards are watched, from the first cached_encode call on the
# module: a forward hook counts each such forward as pending, and the end of a backward that
# accumulated into the module's parameters (a post-accumulate-grad hook: DDP reduced there)
# settles them. bigbatch's own forwards and backwards (re-runs, the memory probe) are not counted
# (a global depth, not a thread-local: CUDA backwards run the hooks on autograd's device threads).
_OWN_DEPTH = [0]


class _Watch:
    """One DDP module's plain synced forwards not yet reduced."""

    def __init__(self) -> None:
        self.pending = 0
        self.queued = False

    def settle(self) -> None:
        self.pending, self.queued = 0, False


_WATCHES: "weakref.WeakKeyDictionary[DistributedDataParallel, _Watch]" = weakref.WeakKeyDictionary()
# per parameter, the watches of the DDP modules that hold it: one hook per parameter however many
# DDP wrappers it has had (a watch goes with its wrapper)
_PARAM_WATCHES = WeakTensorKeyDictionary()


def _accumulated(param: Tensor) -> None:
    """Post-accumulate-grad hook: a backward accumulated into ``param`` outside bigbatch's own
    re-runs, so DDP reduced there: that backward's end settles the watches of ``param``'s modules."""
    if _OWN_DEPTH[0]:
        return
    for watch in list(_PARAM_WATCHES.get(param, ())):
        if watch.pending and not watch.queued:
            watch.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(watch.settle)


_accumulated.bigbatch_watch = True  # accumulate.py's fusion ignores it (it only reads the event)


@contextlib.contextmanager
def own_ddp_forwards() -> Iterator[None]:
    """DDP forwards and backwards inside the block are bigbatch's own (not watched)."""
    _OWN_DEPTH[0] += 1
    try:
        yield
    finally:
        _OWN_DEPTH[0] -= 1


def watch_plain_forwards(ddps: Sequence[DistributedDataParallel]) -> None:
    """From now on, count the plain synced forwards of these DDP modules (hooks installed once)."""
    for d in ddps:
        if d in _WATCHES:
            continue
        watch = _WATCHES[d] = _Watch()

        def forward_hook(module, args, output, watch=watch) -> None:
            if not _OWN_DEPTH[0] and torch.is_grad_enabled() and module.require_backward_grad_sync:
                watch.pending += 1

        d.register_forward_hook(forward_hook)
        for p in d.module.parameters():
            if not p.requires_grad:
                continue
            if p not in _PARAM_WATCHES:
                _PARAM_WATCHES[p] = weakref.WeakSet()
                p.register_post_accumulate_grad_hook(_accumulated)
            _PARAM_WATCHES[p].add(watch)


def agree_no_plain_forward_pending(ddps: Sequence[DistributedDataParallel]) -> None:
    """Before a cached re-run's synced backward: every rank learns whether any rank has a plain
    synced forward of the module still unreduced (one small all-reduce on the DDP module's group,
    which every rank reaches, since the re-run's own reduction is a collective too), and all refuse
    together rather than leave the others waiting in that reduction."""
    from ..distributed.ring import exchange_device

    for d in ddps:
        watch = _WATCHES.get(d)
        mine = bool(watch and watch.pending)
        param = next(d.module.parameters(), None)
        device = exchange_device(d.process_group, param.device if param is not None else None)
        flag = torch.tensor([float(mine)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=d.process_group)
        if flag.item():
            if watch is not None:
                watch.settle()  # this step is abandoned; the next starts clean
            raise RuntimeError(
                "cached_encode under DistributedDataParallel: a plain forward of the same DDP module (grad and "
                f"gradient sync on) {'on this rank' if mine else 'on another rank'} has not been reduced by a "
                "backward yet. DDP reduces one synced forward per backward, and re-running the cached chunks "
                "through it would leave that forward's gradients unsynchronised across ranks. Encode every input "
                "of the module with cached_encode (or use GradCache), or back-propagate the plain forward's loss "
                "first; a forward that is only evaluated or logged belongs under torch.no_grad()")


def is_model_list(m: object) -> bool:
    """An ``nn.ModuleList`` without a forward of its own: a list of models (one per input), not a
    model (a subclass that defines ``forward`` is one model)."""
    return isinstance(m, nn.ModuleList) and type(m).forward is nn.Module.forward


def warn_user(message: str) -> None:
    """``warnings.warn`` attributed to the first caller outside bigbatch and torch (a GradCache
    step, or the ``loss.backward()`` that reached a cached_encode node), so that each call site is
    reported."""
    import os
    import sys
    import warnings

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bigbatch/, whatever it is imported as
    skip = tuple(os.path.join(d, "") for d in (os.path.dirname(os.path.abspath(torch.__file__)), package))
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def check_not_parametrize_cached(what: str, models: Sequence[nn.Module]) -> None:
    """Inside ``torch.nn.utils.parametrize.cached()`` a parametrized weight is computed once and
    reused: pass 1 (without a graph) would fill the cache with a weight that has no graph, and every
    re-run would reuse it, so the parametrization's own parameters would get no gradient. Refused
    when one of ``models`` is parametrized (a parametrized loss head outside them is fine), or when
    no model is known (a function that closes over its model)."""
    from torch.nn.utils import parametrize

    if getattr(parametrize, "_cache_enabled", 0) and (not models or any(  # no module seen: it may close over one
            parametrize.is_parametrized(m) for model in models for m in walk.submodules(model))):
        raise RuntimeError(f"{what} cannot run inside torch.nn.utils.parametrize.cached(): the weights cached "
                           "by its first, graph-free forward would give the parametrizations no gradient; call "
                           "it outside the cached() block")


def check_not_fsdp(model: nn.Module) -> None:
    """Raise ``NotImplementedError`` (with the reason) if ``model`` or a submodule is FSDP-wrapped,
    or ``ValueError`` for a DDP module built with ``static_graph=True``."""
    if any(getattr(d, "static_graph", False) for d in ddp_modules(model)):  # itself or in a wrapper
        raise ValueError(
            "GradCache needs DistributedDataParallel(static_graph=False): a cached step runs each chunk's "
            "forward twice and back-propagates chunk by chunk, which a static graph (one forward and one "
            "backward per iteration, the same every time) does not allow"
        )
    kinds = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        kinds.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - builds without distributed
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        kinds.append(FSDPModule)
    except ImportError:  # pragma: no cover - torch < 2.6
        pass
    if not kinds:
        return
    kinds_t = tuple(kinds)
    for m in walk.submodules(model):
        if isinstance(m, kinds_t):
            raise NotImplementedError(_FSDP_WHY.format(name=type(m).__name__))


def check_loss_params_outside_ddp(loss: torch.Tensor, models: Sequence[nn.Module]) -> None:
    """Raise if the loss graph reaches a parameter of a DDP module built with
    ``find_unused_parameters=False`` (a CLIP ``logit_scale`` inside ``DDP(model)``): DDP arms its
    reducer for the parameters of the synced re-run forward only, so such a parameter would never
    be all-reduced (an unsynchronised step, then DDP's own error). Walks the loss's graph (small:
    the loss's ops and leaves); only with such a DDP module."""
    ddps = [d for m in models for d in ddp_modules(m) if not getattr(d, "find_unused_parameters", False)]
    if not ddps or loss.grad_fn is None:
        return
    owned = {id(p): name for d in ddps for name, p in d.module.named_parameters()}
    found = [owned[id(leaf)] for leaf in graph_leaves(loss) if id(leaf) in owned]
    if found:
        raise ValueError(
            f"loss_fn uses parameters of a DDP-wrapped encoder ({', '.join(sorted(set(found)))}) built with "
            "find_unused_parameters=False: DDP all-reduces only the parameters of a chunk's synced re-run "
            "forward, so these would never be synchronised. Build that DDP module with "
            "find_unused_parameters=True, or keep these parameters outside it and average their gradients over "
            "the ranks yourself (DDP averages only what its own forward produced: a DDP module of their own "
            "works if the loss reads them through that module's forward)")


def check_same_sync_count(ddps: Sequence[DistributedDataParallel], chunks: int) -> None:
    """``ddp_sync="every_chunk"``: each re-run chunk's backward all-reduces, so every rank must
    re-run the same number of chunks of this model, or the ranks would wait in different
    collectives (a hang). One small all-reduce per DDP module and step compares the counts; all
    ranks raise together when they differ."""
    import torch.distributed as dist

    from ..distributed.ring import exchange_device

    for d in ddps:
        group = d.process_group
        device = next((p.device for p in d.module.parameters()), None)
        counts = torch.tensor([chunks, -chunks], dtype=torch.int64, device=exchange_device(group, device))
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
        most, fewest = int(counts[0]), -int(counts[1])
        if most != fewest:
            raise ValueError(
                f'ddp_sync="every_chunk" (no_sync_except_last=False) all-reduces in every re-run chunk, and the '
                f"ranks re-run different numbers of chunks ({fewest} to {most}: uneven local batches or chunk "
                f'sizes), which would hang DDP: use the default ddp_sync="last_chunk" (one all-reduce per step, '
                "exact with uneven batches), or equal chunk counts on every rank")


def sync_context(ddps: Sequence[DistributedDataParallel], sync: bool) -> Callable[[], ContextManager]:
    """A context factory: ``no_sync`` of every DDP module of a model (``ddps``, from
    :func:`ddp_modules`, found once per step) whose gradients must not be all-reduced in this
    backward, else a null context."""
    if sync or not ddps:
        return contextlib.nullcontext

    def no_sync() -> ContextManager:
        stack = contextlib.ExitStack()
        for d in ddps:
            stack.enter_context(d.no_sync())
        return stack

    return no_sync
