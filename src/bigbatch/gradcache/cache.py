"""``GradCache``: one call = one cached step over the whole batch, exact full-batch gradients.

Steps of ``gc(*inputs, **loss_kwargs)`` (B rows per input, chunk c, representation width D):

1. split every input into chunks (``split_input_fn`` or :func:`~.chunking.split_batch`);
   chunk sizes given, or the largest that fits ``memory_budget`` (probed once per input shape);
2. pass 1: encode all chunks without a graph (random state captured per chunk); the last
   chunk(s) keep their graph when the budget has room for it (saves their second forward);
3. the loss on the detached, whole-batch representations; its backward (scaled by ``scaler``
   when given) fills the loss's own parameters' gradients (exact: they see the whole batch)
   and the cached gradient d(loss)/d(reps), B x D per input;
4. pass 2: re-run each chunk under its replayed random state, back-propagate its slice.

Memory: one chunk's forward + backward (or the budget), plus B x D representations and their
gradients per input, plus what the loss needs. Work: one extra forward per re-run chunk.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .head import attach_head
from .budget import ChunkProber, MemoryArg, in_use_at_start, offloads, parse_memory, plan_chunk, planning_budget, probe_cost
from .chunking import batch_size, check_offload_target, chunk_rows, differentiable, model_device, pin, split_chunks
from .engine import EngineOptions, Unit, distinct_models, autocast_state, backprop, encode, finalize_plan
from .inputs import backward_into_originals, inputs_require_grad, with_boundaries
from . import cast_scope, walk
from .cast_scope import CastScope
from .wrappers import (DDP_SYNC_MODES, check_loss_params_outside_ddp, check_not_fsdp, check_not_parametrize_cached,
                       ddp_modules, is_model_list, warn_user)

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
# Chunk sizes and kept graphs are planned against 95% of the budget (the 5%: allocator rounding and
# the loss's own memory) less the cached representations and their gradients (planning_budget).
# On an H200 (BERT-base, bf16, 16 GiB) the measured step peaks were 15.12-15.16 GiB.
_BUDGET_FRACTION = 0.95
# methods a subclass of the public GradCache overrides to customise it; bigbatch takes callables
_PUBLIC_HOOKS = ("split_inputs", "get_input_tensors", "model_call", "get_reps", "compute_loss",
                 "forward_no_grad", "build_cache", "forward_backward")
_FREE_FRACTION = 0.9  # the default budget: what is allocated now plus this share of the free memory


def _identity(x: Any) -> Any:
    return x


def _check_not_fsdp(models: Sequence[nn.Module], get_rep_fn: Any) -> None:
    """The models, and a module ``get_rep_fn`` (it runs as part of each model: head.py)."""
    for m in list(models) + ([get_rep_fn] if isinstance(get_rep_fn, nn.Module) else []):
        check_not_fsdp(m)


def check_callables(**fns: Any) -> None:
    """Each of ``fns`` (name -> value) is ``None`` or callable: caught when the object is built,
    naming the argument, rather than as "'int' object is not callable" in the first step."""
    for name, fn in fns.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be a callable or None, got {type(fn).__name__}")


def _enabled(scaler: Any) -> bool:
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


def check_options(autocast_dtype, scaler, ddp_sync) -> None:
    if autocast_dtype is not None and autocast_dtype not in _AUTOCAST_DTYPES:
        raise ValueError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, got {autocast_dtype!r}")
    if scaler is not None and not (hasattr(scaler, "scale") and hasattr(scaler, "step")):
        raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if ddp_sync not in DDP_SYNC_MODES:
        raise ValueError(f"ddp_sync must be one of {DDP_SYNC_MODES}, got {ddp_sync!r}")


def check_chunk_sizes(chunk_sizes: Any) -> List[int]:
    """One positive int, or a list/tuple of them (numpy and other integral types accepted)."""
    def positive_int(c: Any) -> bool:
        return isinstance(c, numbers.Integral) and not isinstance(c, bool) and int(c) >= 1

    if positive_int(chunk_sizes):
        return [int(chunk_sizes)]
    if isinstance(chunk_sizes, (list, tuple)) and chunk_sizes and all(positive_int(c) for c in chunk_sizes):
        return [int(c) for c in chunk_sizes]
    raise ValueError(f"chunk_sizes must be a positive int or a non-empty list of positive ints (one per input), "
                     f"got {chunk_sizes!r}")


def default_budget(device: torch.device, chunk_arg: str = "chunk_sizes") -> int:
    """On CUDA: what is allocated now plus 90% of what this process could still allocate: the
    device's free memory and the blocks PyTorch's caching allocator holds unused (reserved, not
    allocated; the device counts them as taken, so after a first step they would otherwise shrink
    the budget to what the allocator never reserved); on other devices a budget must be given
    (``chunk_arg``: the caller's chunk argument)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = max(torch.cuda.memory_reserved(device) - allocated, 0)
        return allocated + int((free + cached) * _FREE_FRACTION)
    raise ValueError(
        f"{chunk_arg}=None needs a memory_budget on {device.type} (memory cannot be measured there "
        f"the way it is on CUDA): pass {chunk_arg}=<rows per chunk> or memory_budget='4GiB'"
    )


class GradCache:
    """Gradient caching for one or several encoders (the GradCache paper, exact, with AMP, DDP, offload).

    Args:
        models: one ``nn.Module`` (shared by every input) or a list: one module per input, or a single
            module shared by all inputs. Modules may be wrapped in ``DistributedDataParallel``. A module
            with no parameter that requires grad (a locked tower, as in LiT) is encoded once, without a
            graph, and never re-run.
        chunk_sizes: rows per chunk, an int or one per input; ``None`` chooses the largest chunk whose
            forward + backward fits ``memory_budget`` (per input: short queries get larger chunks).
        loss_fn: ``loss_fn(*reps, **loss_kwargs) -> scalar``; may have parameters of its own (a learned
            head, a logit scale): they get exact full-batch gradients.
        split_input_fn: ``(inputs, chunk_size) -> list of chunks``; default splits tensors, mappings
            (dict, BatchEncoding), lists, tuples and dataclasses along dimension 0.
        get_rep_fn: model output -> (rows, ...) representation tensor; default (``None``): the output itself.
        fp16: the public GradCache's switch: ``autocast_dtype=torch.float16``, which needs ``scaler``.
        scaler: a ``torch.amp.GradScaler`` (fp16): the loss is scaled before the cache is built, so the
            cached gradients and the parameter gradients are scaled; call ``scaler.step``/``update`` after.
            An enabled scaler without fp16 (``fp16``/``autocast_dtype``, or a float16 autocast region
            around the call) is an error: the public package ignores it there.
            Non-finite cached gradients propagate to ``.grad`` so the scaler skips that step.

    Keyword-only (bigbatch's own; the arguments above keep the public package's positions):
        memory_budget: bytes or a string like ``"16GiB"``: the step's peak memory. On CUDA the device's
            whole allocation (``torch.cuda.memory_allocated``), so what is allocated when the step starts
            (weights, optimizer state, ``.grad``) counts; default: that plus 90% of the free memory
            (free on the device or held unused by PyTorch's allocator). On the CPU (no allocator
            statistics) the memory the step adds, estimated; a budget or chunk sizes are required there.
        autocast_dtype: run encoders and loss under ``torch.autocast`` with this dtype (bf16/fp16).
        offload_inputs: keep inputs on the CPU (pinned); each chunk is copied to the model's device on a
            side stream, overlapped with the previous chunk's compute.
        offload_reps: keep cached representations and their gradients on the CPU between passes
            (no effect for a model on the CPU).
        ddp_sync: ``"last_chunk"`` (DDP all-reduces once per step) or ``"every_chunk"``.
        keep_last_graph: keep the graph of the last chunk(s) of pass 1 when the budget allows, instead of
            re-running them (one chunk's forward saved per step).

    ``gc(..., no_sync_except_last=True/False)`` is accepted as in the public GradCache and sets
    ``ddp_sync`` for that step (``"last_chunk"`` / ``"every_chunk"``); it is not passed to ``loss_fn``.

    Calling ``gc(*inputs, **loss_kwargs)`` runs one cached step: it accumulates into ``.grad`` of every
    parameter (encoders and loss) and returns the detached, unscaled loss (in ``loss_fn``'s shape).
    Buffers that a forward
    updates (BatchNorm's running statistics) are updated once per chunk, as in a plain chunked loop;
    BatchNorm in training mode normalises each chunk with that chunk's statistics.

    After a step, per input: ``last_chunk_sizes`` (the chunk size used; with a budget, the largest
    that fits), ``last_chunk_rows`` (the rows of every chunk: with a budget the largest chunk comes
    last, the rest are split evenly) and ``last_kept_rows`` (rows whose pass-1 graph was kept).
    """

    def __init__(
        self,
        models: Union[nn.Module, Sequence[nn.Module]],
        chunk_sizes: Union[int, Sequence[int], None] = None,
        loss_fn: Optional[Callable[..., Tensor]] = None,
        split_input_fn: Optional[Callable[[Any, int], List[Any]]] = None,
        get_rep_fn: Optional[Callable[[Any], Tensor]] = None,
        fp16: bool = False,
        scaler: Optional[Any] = None,
        *,
        memory_budget: MemoryArg = None,
        autocast_dtype: Optional[torch.dtype] = None,
        offload_inputs: bool = False,
        offload_reps: bool = False,
        ddp_sync: str = "last_chunk",
        keep_last_graph: bool = True,
    ) -> None:
        hooks = [n for n in _PUBLIC_HOOKS if hasattr(type(self), n)]
        if hooks:
            raise TypeError(
                f"{type(self).__name__} overrides {', '.join(hooks)}: bigbatch.GradCache does not call the public "
                "package's hook methods; pass split_input_fn=, get_rep_fn= and loss_fn= (a model_call "
                "override: wrap the model in an nn.Module) instead"
            )
        if fp16:
            if autocast_dtype not in (None, torch.float16):
                raise ValueError(f"fp16=True means autocast_dtype=torch.float16, got autocast_dtype={autocast_dtype!r}")
            if scaler is None:
                raise ValueError("fp16=True needs scaler=torch.amp.GradScaler() (fp16 gradients underflow without one)")
            autocast_dtype = torch.float16
        if not isinstance(models, (nn.Module, list, tuple)):
            raise TypeError(f"models must be an nn.Module or a non-empty list of nn.Modules, got {type(models).__name__}")
        # an nn.ModuleList without a forward holds one model per input, as a list does
        single = isinstance(models, nn.Module) and not is_model_list(models)
        self.models: List[nn.Module] = [models] if single else list(models)
        if not self.models or not all(isinstance(m, nn.Module) for m in self.models):
            raise TypeError("models must be an nn.Module or a non-empty list of nn.Modules")
        _check_not_fsdp(self.models, get_rep_fn)
        if loss_fn is None or not callable(loss_fn):
            raise TypeError("loss_fn must be a callable (*reps, **loss_kwargs) -> scalar tensor")
        check_callables(split_input_fn=split_input_fn, get_rep_fn=get_rep_fn)
        check_options(autocast_dtype, scaler, ddp_sync)
        if chunk_sizes is not None:
            chunk_sizes = check_chunk_sizes(chunk_sizes)
        if chunk_sizes is not None and len(self.models) > 1 and len(chunk_sizes) not in (1, len(self.models)):
            raise ValueError(f"chunk_sizes has {len(chunk_sizes)} entries for {len(self.models)} models: give one "
                             "size, or one per model (input)")
        if chunk_sizes is not None and len(chunk_sizes) == 1 and len(self.models) > 1:
            chunk_sizes = chunk_sizes * len(self.models)  # one per model, as the public package keeps them
        self.chunk_sizes: Optional[List[int]] = chunk_sizes
        self.loss_fn = loss_fn
        self.split_input_fn = split_input_fn
        self.get_rep_fn = get_rep_fn  # None: the model's output itself
        self.fp16 = autocast_dtype == torch.float16
        self.memory_budget = parse_memory(memory_budget)
        self.scaler = scaler
        self.autocast_dtype = autocast_dtype
        self.offload_inputs = offload_inputs
        self.offload_reps = offload_reps
        self.ddp_sync = ddp_sync
        self.keep_last_graph = keep_last_graph
        self._prober = ChunkProber()
        self._walks = walk.Carried()
        self.last_chunk_sizes: List[int] = []  # what the last step used, per input (for logs/benchmarks)
        self.last_chunk_rows: List[List[int]] = []  # per input: the rows of each chunk of the last step
        self.last_kept: int = 0  # how many chunks kept their pass-1 graph in the last step
        self.last_kept_rows: List[int] = []  # per input: rows whose pass-1 graph was kept (not re-run)

    def __call__(self, *inputs: Any, **loss_kwargs: Any) -> Tensor:
        return self.cache_step(*inputs, **loss_kwargs)

    # -- planning -------------------------------------------------------------------------
    def _models_for(self, n: int) -> List[nn.Module]:
        """The model of each input, as the engine runs it (a module ``get_rep_fn`` inside it)."""
        if len(self.models) == 1:
            models = self.models * n
        elif len(self.models) != n:
            raise ValueError(f"got {n} inputs for {len(self.models)} models: pass one input per model "
                             "(or a single shared model)")
        else:
            models = self.models
        made: Dict[int, nn.Module] = {}  # one per distinct model: a shared encoder stays shared
        for m in models:
            if id(m) not in made:
                made[id(m)] = attach_head(m, self.get_rep_fn)[0]
        return [made[id(m)] for m in models]

    def _rep_fn(self) -> Callable[[Any], Tensor]:
        """What the engine applies to a model's output (a module ``get_rep_fn`` runs inside the model)."""
        return _identity if self.get_rep_fn is None or isinstance(self.get_rep_fn, nn.Module) else self.get_rep_fn

    def _sizes(self, models: List[nn.Module], inputs: Sequence[Any]):
        """Per input: chunk size and cost model (``None`` without a budget); and the bytes chunks and
        kept graphs are planned against (``None`` without a budget)."""
        if self.chunk_sizes is not None:
            sizes = self.chunk_sizes * len(inputs) if len(self.chunk_sizes) == 1 else self.chunk_sizes
            if len(sizes) != len(inputs):
                raise ValueError(f"chunk_sizes has {len(sizes)} entries for {len(inputs)} inputs")
            if self.memory_budget is None:
                return list(sizes), [None] * len(inputs), None
        # a budget is planned from the batch sizes (inputs of a custom type need chunk_sizes)
        hint = ("memory_budget measures batched tensors, also to plan the kept graphs when chunk_sizes is given: "
                "drop memory_budget for this input type") if self.chunk_sizes is not None else \
            "a memory budget plans from batched tensors: pass chunk_sizes"
        batches = [batch_size(x, f"inputs[{i}]", hint=hint) for i, x in enumerate(inputs)]
        if self.chunk_sizes is not None:
            costs = [self._cost(m, x) for m, x in zip(models, inputs)]
            return list(sizes), costs, self._usable(self.memory_budget, models, inputs, costs, batches)
        budget = self.memory_budget or default_budget(model_device(models[0], inputs[0]))
        costs = [self._cost(m, x) for m, x in zip(models, inputs)]
        usable = self._usable(budget, models, inputs, costs, batches)
        plans = [self._plan(m, x, c, usable) for m, x, c in zip(models, inputs, costs)]
        return [rows for rows, _ in plans], [c for _, c in plans], usable

    def _usable(self, budget: int, models: Sequence[nn.Module], inputs: Sequence[Any], costs, batches: Sequence[int]) -> int:
        devices = [model_device(m, x) for m, x in zip(models, inputs)]
        cached = sum(c.cached(b) for c, b, d in zip(costs, batches, devices) if not offloads(self.offload_reps, d))
        can_offload = not self.offload_reps and any(d.type != "cpu" for d in devices)
        return planning_budget(budget, _BUDGET_FRACTION, cached, in_use_at_start(devices, models), can_offload)

    def _cost(self, model: nn.Module, x: Any):
        # (the probe bypasses the forward of every DDP module in the model: wrappers.ddp_bypassed)
        return probe_cost(self._prober, model, x, self._rep_fn(), self._amp(model, x), self.autocast_dtype,
                          custom_split=self.split_input_fn is not None)

    def _plan(self, model: nn.Module, x: Any, cost, usable: int):
        """The largest chunk of ``x`` that fits ``usable`` bytes and its (on CUDA: measured) cost."""
        return plan_chunk(self._prober, model, x, self._rep_fn(), self._amp(model, x), self.autocast_dtype, cost,
                          usable, custom_split=self.split_input_fn is not None)

    def _amp(self, model: nn.Module, x: Any):
        from .engine import _autocast

        return _autocast(model_device(model, x), self.autocast_dtype)

    def _plan_keep(self, units: List[Unit], costs, usable: Optional[int], trainable: Sequence[bool]) -> None:
        """Flag the last chunks of pass 1 whose graphs fit ``usable`` bytes (without a budget: the
        last chunk). A frozen model's chunks build no graph: they are never kept, nor re-run."""
        if not self.keep_last_graph:
            return
        candidates = [u for u in units if trainable[u.input_index]]
        if usable is None:
            if candidates:
                candidates[-1].keep = True
            return
        # Walk back from the last chunk: a kept graph lives from its pass-1 forward to pass 2, so it
        # must fit beside the graphs kept after it (``held``) and beside the no-grad forwards of the
        # frozen chunks that run after it (``later``: the largest of their peaks).
        held, later = 0.0, 0.0
        for u in reversed(units):
            cost = costs[u.input_index]
            if not trainable[u.input_index]:
                later = max(later, cost.peak(u.rows))
                continue
            if held + cost.peak(u.rows) > usable or held + cost.held(u.rows) + later > usable:
                break
            u.keep = True
            held += cost.held(u.rows)

    # -- the step -------------------------------------------------------------------------
    def cache_step(self, *inputs: Any, no_sync_except_last: Optional[bool] = None, **loss_kwargs: Any) -> Tensor:
        """Run one cached step; see the class docstring."""
        # the walks of the models' structure, carried from the last step while it holds (walk.py)
        with walk.one_walk(self._walks, distinct_models(self.models)):
            return self._step(inputs, no_sync_except_last, loss_kwargs)

    def _step(self, inputs: Tuple[Any, ...], no_sync_except_last: Optional[bool], loss_kwargs: Dict[str, Any]) -> Tensor:
        if not inputs:
            raise ValueError("GradCache needs at least one input")
        if torch.is_inference_mode_enabled():
            raise RuntimeError("GradCache runs a backward: it cannot run under torch.inference_mode()")
        if not torch.is_grad_enabled():  # a plain step's loss.backward() fails there too
            raise RuntimeError("GradCache runs a backward and accumulates into .grad: it cannot run under "
                               "torch.no_grad(); for a loss without gradients, encode with the models under "
                               "no_grad and call the loss yourself")
        check_not_parametrize_cached("GradCache", self.models)
        _check_not_fsdp(self.models, self.get_rep_fn)  # again per step: fully_shard() converts in place
        if (self.scaler is not None and not self.fp16 and _enabled(self.scaler)
                and torch.float16 not in [dt for _, dt in autocast_state()]):  # (nor a caller's fp16 region)
            raise ValueError(
                "GradCache: an enabled scaler without fp16 (autocast_dtype is "
                f"{self.autocast_dtype!r} and no float16 autocast region is open): the loss, and with it .grad, "
                "would be scaled by the scaler's factor, which the public GradCache does not do without fp16 "
                "(a plain optimizer.step() would take a 65536x step). Set fp16=True (or autocast_dtype=torch.float16), "
                "or drop the scaler (a GradScaler(enabled=False) is accepted)")
        ddp_sync = self.ddp_sync if no_sync_except_last is None else ("last_chunk" if no_sync_except_last else "every_chunk")
        models = self._models_for(len(inputs))
        # A model is re-run if a parameter or an input tensor of it requires grad; a frozen one
        # (no parameter requires grad, e.g. a locked tower as in LiT) fed plain inputs is encoded
        # once without a graph, its representations get no gradient and it is never re-run.
        trainable = [any(p.requires_grad for p in walk.parameters(m)) or inputs_require_grad(x) for m, x in zip(models, inputs)]
        bounded = [with_boundaries(x, leaves_too=False) for x in inputs]
        inputs = tuple(x for x, _ in bounded)
        boundaries = [pair for _, pairs in bounded for pair in pairs]
        if self.offload_inputs:
            check_offload_target(models)
            inputs = tuple(pin(x) for x in inputs)
        sizes, costs, usable = self._sizes(models, inputs)
        units: List[Unit] = []
        for i, (m, x, c) in enumerate(zip(models, inputs, sizes)):
            if self.split_input_fn is None:  # the built-in split needs batched tensors it can see
                batch_size(x, f"inputs[{i}]", hint="pass split_input_fn= to split another type")
            ddps = ddp_modules(m)
            for chunk in split_chunks(x, c, split_input_fn=self.split_input_fn, from_budget=self.chunk_sizes is None):
                units.append(Unit(i, m, chunk, chunk_rows(chunk, self.split_input_fn is not None, f"a chunk of inputs[{i}]"),
                                  rerun=trainable[i], ddps=ddps))
        self._plan_keep(units, costs, usable, trainable)
        finalize_plan(units)
        self.last_chunk_sizes, self.last_kept = sizes, sum(u.keep for u in units)
        opts = EngineOptions(self._rep_fn(), self.autocast_dtype, self.offload_inputs, self.offload_reps, ddp_sync)
        # one autocast context from the last model of pass 1 into its re-runs (cast_scope.py)
        scope = CastScope() if (self.autocast_dtype is not None and cast_scope.ENABLED
                                and not cast_scope.gradless_casts_cached()) else None
        try:
            reps = encode(units, opts, len(inputs), scope)
            # an input whose representation required grad without a registered trainable parameter
            # (engine.EngineOptions.detect_hidden) is trained after all
            trainable = [t or any(u.rerun for u in units if u.input_index == i) for i, t in enumerate(trainable)]
            self.last_chunk_rows = [[u.rows for u in units if u.input_index == i] for i in range(len(inputs))]
            self.last_kept_rows = [sum(u.rows for u in units if u.keep and u.input_index == i) for i in range(len(inputs))]
            for i, t in enumerate(trainable):  # (no loop variable left holding a representation)
                if t and not differentiable(reps[i]):
                    raise TypeError(f"get_rep_fn must return a floating or complex tensor (input {i}'s representation "
                                    f"is {reps[i].dtype})")
            leaves = [r.detach().requires_grad_(t) for r, t in zip(reps, trainable)]
            device = leaves[0].device
            amp = torch.autocast(device.type, dtype=self.autocast_dtype) if self.autocast_dtype else _null()
            with torch.enable_grad(), amp:
                # loss_fn gets non-leaf copies (B x D each), as a plain step gets the encoders' outputs:
                # in-place ops on them (a.mul_(2)) are allowed there, and on a leaf they are an error
                loss = self.loss_fn(*[leaf.clone() if leaf.requires_grad else leaf for leaf in leaves], **loss_kwargs)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise ValueError("loss_fn must return a scalar tensor")
            if not loss.requires_grad:
                raise ValueError("loss_fn's result has no grad_fn: it does not depend on the representations of "
                                 "a trainable encoder, and the loss has no parameter that requires grad")
            check_loss_params_outside_ddp(loss, models)
            # with inputs that require grad through a graph of their own (boundaries), or trainable
            # tensors a model does not register (Unit.hidden: merged weights W + A @ B), the loss may
            # use them too (a regulariser): their graph is crossed again by backward_into_originals or
            # the re-runs, so the loss's backward keeps it (and, with it, the loss's own saved
            # tensors, until the step returns)
            retain = bool(boundaries) or any(u.hidden for u in units)
            with scope.suspended() if scope is not None else contextlib.nullcontext():
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward(retain_graph=retain)
            grads, loss = [leaf.grad for leaf in leaves], loss.detach()
            if self.offload_reps:
                # the plan counts neither R nor G on the device: both leave it before the re-runs (the
                # loss's graph, dropped above, held the leaves through its AccumulateGrad nodes)
                grads = [None if g is None else g.to("cpu") for g in grads]
                del reps, leaves
            sent, graphs = backprop(units, grads, opts, scope)
            if scope is not None:  # before any other backward (the inputs' own graphs): autocast off
                scope.close()
            del grads
            if sent and not graphs:  # a plain step would train the loss's own parameters only, or fail
                warn_user(
                    "GradCache: no chunk of a trained encoder built a graph: their forwards used no tensor that "
                    "requires grad (an encoder run under torch.no_grad(), or outputs detached inside the model); "
                    "the encoders got no gradient")
            backward_into_originals(boundaries)
        finally:
            if scope is not None:
                scope.close()
            for u in units:  # never leave a kept graph alive after an error
                u.kept_rep = None
        return loss


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
