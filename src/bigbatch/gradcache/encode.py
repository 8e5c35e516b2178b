"""``cached_encode``: gradient caching as an autograd node, for training loops you don't own.

``reps = cached_encode(model, inputs, chunk_size=...)`` encodes the batch chunk by chunk without
a graph and returns (B, ...) representations with a ``grad_fn``. Use them in any loss; when the
caller's ``loss.backward()`` reaches them, the node re-runs each chunk (random state replayed,
the autocast setting of the forward restored) and back-propagates that chunk's slice of the
incoming gradient, accumulating into the encoder parameters' ``.grad`` (like reentrant
activation checkpointing: ``torch.autograd.grad`` w.r.t. encoder parameters is refused with a
clear error; ``backward(inputs=[...])`` restricts which parameters accumulate). Input tensors
that require grad get their gradients through the node, as from a plain forward.
A GradScaler-scaled loss yields scaled parameter gradients, as usual. Memory: one chunk's
forward + backward; work: one extra forward per chunk.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, List, Optional

import torch
from torch import Tensor, nn

from .._autograd import refuse_batched, refuse_create_graph
from .head import attach_head
from .budget import ChunkProber, MemoryArg, in_use_at_start, parse_memory, plan_chunk, planning_budget, probe_cost
from .cache import _BUDGET_FRACTION, _identity, check_callables, check_options, default_budget
from .chunking import batch_size, check_offload_target, chunk_rows, model_device, pin, split_chunks
from .engine import EngineOptions, Unit, _autocast, backprop, encode, finalize_plan
from .inputs import Pairs, inputs_require_grad, with_boundaries
from . import walk
from .wrappers import (check_not_fsdp, check_not_parametrize_cached, ddp_modules, is_model_list, warn_user,
                       watch_plain_forwards)

_PROBER = ChunkProber()


class _CachedEncode(torch.autograd.Function):
    """Forward: pass 1 (no graph). Backward: pass 2, parameter gradients accumulated into ``.grad``.

    Inputs: ``anchor`` (an empty tensor that requires grad, so the output is always part of the
    caller's graph), then the input tensors that require grad (their gradients are returned, from
    the boundaries the chunks were cut from), then the encoder's trainable parameters (returned
    ``None``: their gradients go to ``.grad`` directly; listed so that ``backward(inputs=...)``
    reaches this node and can restrict which of them are accumulated)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, box: List[Tensor], units: List[Unit], opts: EngineOptions, pairs: Pairs,  # type: ignore[override]
                *tensors: Tensor) -> Tensor:
        ctx.units, ctx.opts, ctx.boundaries, ctx.anchor = units, opts, [b for _, b in pairs], anchor
        ctx.params = list(tensors[len(pairs):])
        # pass 1 ran before the node was made (``cached_encode``); its result comes in a box, not
        # as a tensor input, so that the output is a fresh tensor (not a view: in-place ops work)
        return box.pop()

    @staticmethod
    @walk.walked
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        refuse_create_graph("cached_encode's representations", "its re-runs accumulate constant "
                            "gradients into .grad; use a plain forward for higher derivatives")
        refuse_batched("cached_encode's representations", "its re-runs accumulate into .grad", [grad])
        units, opts = ctx.units, ctx.opts
        if units is not None:  # before any chunk re-runs (the node stays usable outside the block)
            check_not_parametrize_cached("cached_encode's backward", list({id(u.model): u.model for u in units}.values()))
        if units is None:
            raise RuntimeError("cached_encode: backward ran twice through the same representations (e.g. "
                               "l1.backward(retain_graph=True); l2.backward()): its chunks are re-run once, in "
                               "the first backward; back-propagate the sum of the losses once (l1 + l2)")
        # before the node is spent: a refused torch.autograd.grad leaves it for the caller's backward
        targets = _targets(ctx.anchor, ctx.params)
        ctx.units = None  # a second backward through this node is an error (its graphs are spent)
        if targets is not None:
            opts = replace(opts, grad_targets=targets + ctx.boundaries)
        with torch.enable_grad():
            sent, graphs = backprop(units, [grad], opts)
        if sent and not graphs:  # as the plain forward's output would have had no grad_fn
            warn_user("cached_encode: no chunk of the encoder built a graph (its forward used no tensor that "
                      "requires grad: run under torch.no_grad(), or only frozen parts of a shared module); "
                      "it sent no gradient")
        in_grads = []
        for b in ctx.boundaries:
            in_grads.append(b.grad)
            b.grad = None
        return (None, None, None, None, None, *in_grads, *([None] * len(ctx.params)))


_AUTOGRAD_GRAD = (
    "cached_encode: torch.autograd.grad cannot return the encoder's parameter gradients (they are "
    "accumulated into .grad chunk by chunk); call loss.backward() instead (backward(inputs=[...]) may "
    "restrict it). autograd.grad w.r.t. the inputs works when no encoder parameter requires grad.")


def _will_execute(t: Tensor) -> bool:
    """Whether the running backward computes ``t``'s gradient (raises under ``torch.autograd.grad``
    when ``t`` is a leaf it was asked for)."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(t).node)
    except RuntimeError as exc:
        if "autograd.grad" not in str(exc):
            raise
        raise RuntimeError(_AUTOGRAD_GRAD) from None


def _targets(anchor: Tensor, params: List[Tensor]) -> Optional[List[Tensor]]:
    """The parameters this backward accumulates into: ``None`` for every leaf the re-runs reach (a
    plain ``.backward()``, which reaches the node's ``anchor`` too), else those that
    ``backward(inputs=...)`` asked for (none under ``torch.autograd.grad``, which returns
    gradients instead of accumulating them; asking it for a trainable encoder's parameters is an
    error: their gradients can only go to ``.grad``). A restricted backward cannot be asked
    whether it wants a trainable tensor the model does not register (the outer graph never saw
    it): such tensors accumulate only under a plain ``.backward()`` (docs: Limits)."""
    try:
        if _will_execute(anchor):
            return None
        return [p for p in params if _will_execute(p)]
    except AttributeError:  # a torch without these hooks: accumulate into all
        return None


@walk.walked
def cached_encode(
    model: nn.Module,
    inputs: Any,
    chunk_size: Optional[int] = None,
    memory_budget: MemoryArg = None,
    get_rep_fn: Optional[Callable[[Any], Tensor]] = None,
    *,
    split_input_fn: Optional[Callable[[Any, int], List[Any]]] = None,
    autocast_dtype: Optional[torch.dtype] = None,
    offload_inputs: bool = False,
    offload_reps: bool = False,
    ddp_sync: str = "last_chunk",
    keep_last_graph: bool = False,
) -> Tensor:
    """Encode ``inputs`` in chunks; the result's backward re-runs the chunks (gradient caching).

    Args:
        model: the encoder. May be DDP-wrapped: each call's backward all-reduces once (in its last
            re-run chunk; earlier chunks run under ``no_sync``), so two calls in a step mean two
            all-reduces -- exact in any backward order, because the gradients already averaged by
            the first are identical on every rank and averaging is linear.
        inputs: tensor, mapping (dict, BatchEncoding), list or tuple with batch dimension 0.
        chunk_size: rows per chunk; ``None`` picks the largest chunk whose forward + backward fits
            ``memory_budget`` (the step's peak; on CUDA the device's whole allocation, default: what is
            allocated plus 90% of the free memory, free on the device or held unused by PyTorch's
            allocator; on CPU one of the two is required).
        get_rep_fn: model output -> (rows, ...) representation; default: the output itself.
        split_input_fn: custom ``(inputs, chunk_size) -> chunks``.
        autocast_dtype: autocast dtype for both passes; ``None`` inherits the caller's autocast state.
        offload_inputs / offload_reps / ddp_sync: as for :class:`~bigbatch.GradCache`; but the
            representation is returned on the model's device for the caller's loss and its gradient
            arrives there, so ``offload_reps`` only keeps pass 1's per-chunk representations off the
            device, and a ``memory_budget`` counts the whole batch's representation and gradient.
        keep_last_graph: keep the last chunk's graph until the backward (saves its re-run; costs its
            activations during the caller's loss).

    Returns:
        (B, ...) representations with a ``grad_fn`` when grad mode is on and a parameter requires grad.
    """
    if not isinstance(model, nn.Module) or is_model_list(model):
        raise TypeError(f"model must be an nn.Module with a forward (one encoder per call), got {type(model).__name__}")
    check_callables(get_rep_fn=get_rep_fn, split_input_fn=split_input_fn)
    model, get_rep_fn = attach_head(model, get_rep_fn)  # a module get_rep_fn: tracked as part of the model
    check_not_fsdp(model)
    check_options(autocast_dtype, None, ddp_sync)
    device = model_device(model, inputs)
    if autocast_dtype is None and torch.is_autocast_enabled(device.type):
        autocast_dtype = torch.get_autocast_dtype(device.type)
    get_rep = get_rep_fn or _identity
    if offload_inputs:
        check_offload_target([model])
        inputs = pin(inputs)
    trained = any(p.requires_grad for p in walk.parameters(model))
    needs_grad = torch.is_grad_enabled() and (trained or inputs_require_grad(inputs))
    if needs_grad:
        check_not_parametrize_cached("cached_encode", [model])

    # inputs that require grad: chunks are cut from boundaries whose gradients the node returns
    bounded, pairs = with_boundaries(inputs, leaves_too=True) if needs_grad else (inputs, [])
    budget = parse_memory(memory_budget)
    sized_from_budget = chunk_size is None
    if sized_from_budget:
        budget = budget or default_budget(device, "chunk_size")
        cost = probe_cost(_PROBER, model, bounded, get_rep, _autocast(device, autocast_dtype), autocast_dtype,
                          custom_split=split_input_fn is not None)
        b = batch_size(inputs)
        # the representation returns to the device for the caller's loss, and its gradient arrives
        # there: both live through the backward's re-runs, offload_reps or not
        cached = cost.cached(b)
        taken = in_use_at_start([device], [model] if needs_grad else [])  # no backward: no .grad made
        usable = planning_budget(budget, _BUDGET_FRACTION, cached, taken, can_offload=False)
        chunk_size, _ = plan_chunk(_PROBER, model, bounded, get_rep, _autocast(device, autocast_dtype), autocast_dtype,
                                   cost, usable, custom_split=split_input_fn is not None)
    chunks = split_chunks(bounded, chunk_size, split_input_fn=split_input_fn, from_budget=sized_from_budget)
    ddps = ddp_modules(model)
    units = [Unit(0, model, c, chunk_rows(c, split_input_fn is not None, "a chunk of inputs"), ddps=ddps) for c in chunks]
    # no autocast at the forward: none in the backward's re-runs either, whatever region it runs in
    opts = EngineOptions(get_rep, autocast_dtype, offload_inputs, offload_reps, ddp_sync, inherit_autocast=False,
                         check_plain_ddp=needs_grad and bool(ddps))
    if opts.check_plain_ddp:
        watch_plain_forwards(ddps)
    if not needs_grad:  # no registered parameter or input is trained: plain no-grad forwards ...
        for u in units:
            u.rerun = False
        detect = replace(opts, detect_hidden=torch.is_grad_enabled())
        with torch.no_grad():
            rep = encode(units, detect, 1)[0]
        if not any(u.rerun for u in units):
            return rep
        # ... unless, in grad mode, a representation required grad all the same (a trainable tensor
        # the model does not register): its chunks are re-run in the backward like any others
    else:
        units[-1].keep = keep_last_graph
        finalize_plan(units)
        # pass 1 runs before the node is made, so the node lists the parameters as the first forward
        # left them (a lazy module's are materialised by then; backward(inputs=...) can name them)
        with torch.no_grad():
            rep = encode(units, opts, 1)[0]
        if units[-1].keep and len(units) == 1:  # the kept graph's own output: a copy, so in-place ops stay allowed
            rep = rep.clone()
    anchor = torch.empty(0, device=device, requires_grad=True)
    params = [p for p in walk.parameters(model) if p.requires_grad]
    return _CachedEncode.apply(anchor, [rep], units, opts, pairs, *[o for o, _ in pairs], *params)
