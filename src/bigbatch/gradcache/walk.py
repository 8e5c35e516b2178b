"""A model's submodules, parameters and buffers, walked once per model and cached step (or less).

A cached step reads the model's structure in many places: its DDP modules, buffers and frozen
parameters (``buffers.py``), LayerNorms (``norms.py``), parameter versions and modes
(``model_state.py``), CUDA devices (``rng.py``), lazy modules, the planner's signature, the
fused accumulation's parameter list. Each ``nn.Module.modules()`` / ``.parameters()`` walk of a
BERT-base (228 submodules, 199 parameters) costs 0.15-0.3 ms of Python, and a step made ~40 of
them: 10-30 ms of host time per step, during which the GPU waits -- at the start of a step nothing
is queued yet, and at B = 512 the benchmark's cached step is host-bound (its kernels keep the GPU
busy for 177 ms of a 195-235 ms step; ``experiments/gradcache_bimodal_probe.py``).

Inside :func:`one_walk` (a whole ``GradCache`` step, one ``cached_encode`` forward or backward,
one ``cached`` call) the walks are memoised per module object; outside it every call walks
afresh. What is memoised is *membership* in ``modules()`` / ``parameters()`` / ``buffers()``
order; anything that may change (``requires_grad``, ``.grad``, devices, modes, versions) is read
by the callers when they use it. A forward that attaches a submodule or registers a buffer is
seen by ``buffers.py``'s fresh walk after each pass-1 forward, which then calls :func:`forget`.

A ``GradCache`` also carries the memo from one step to the next (:class:`Carried`): at a step's
start one :meth:`Structure.same_objects` check (the modules, their dicts and children, and the
very parameter and buffer objects they hold) replaces the step's walks: from the call to the
first forward 4.4 -> 2.3 ms of host time for two 12-layer BERTs on this project's CPU, at the
start of a step, when the GPU has nothing queued yet.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

# .memo: (kind, id(module)) -> (module, value), None outside one_walk(); .structure: the carried
# walk's Structure (None without one); .forgotten: forget() ran in this one_walk()
_LOCAL = threading.local()


@contextlib.contextmanager
def one_walk(carried: Optional["Carried"] = None, models: Sequence[nn.Module] = ()) -> Iterator[None]:
    """Memoise the walks below until the outermost ``with`` exits (nested: the outer one's memo).
    With ``carried`` (its owner's, for ``models``), start from the memo it kept at the last exit
    when the models still hold the same objects, and keep this one's for the next."""
    if getattr(_LOCAL, "memo", None) is not None:
        yield
        return
    structure = None
    if carried is None:
        _LOCAL.memo = {}
    else:
        _LOCAL.memo, structure = carried.take(models)
    _LOCAL.structure, _LOCAL.forgotten = structure, False
    try:
        yield
    finally:
        if carried is not None and not _LOCAL.forgotten:
            carried.keep(_LOCAL.memo, structure)
        _LOCAL.memo = _LOCAL.structure = None


def walked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run inside :func:`one_walk` (a decorator for the entry points of a step)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with one_walk():
            return fn(*args, **kwargs)
    return run


def forget() -> None:
    """Drop what was memoised (the structure changed: a forward attached a module or a buffer);
    nothing of this step is carried to the next."""
    if getattr(_LOCAL, "memo", None) is not None:
        _LOCAL.memo = {}
        _LOCAL.structure, _LOCAL.forgotten = None, True


def step_structure(models: Sequence[nn.Module]) -> Optional["Structure"]:
    """The carried walk's :class:`Structure` of exactly ``models`` (in this order) at this step's
    start, while nothing was forgotten since; else ``None``."""
    s = getattr(_LOCAL, "structure", None)
    return s if s is not None and s.walks(models) else None


def memoised(kind: str, module: nn.Module, compute: Callable[[nn.Module], Any]) -> Any:
    """``compute(module)``, computed once per ``kind`` and module inside :func:`one_walk`. The value
    must depend only on the module's structure (which objects it holds), and must not be mutated."""
    memo: Dict[Tuple[str, int], Tuple[nn.Module, Any]] = getattr(_LOCAL, "memo", None)
    if memo is None:
        return compute(module)
    key = (kind, id(module))
    hit = memo.get(key)
    if hit is not None and hit[0] is module:
        return hit[1]
    value = compute(module)
    memo[key] = (module, value)  # holds the module: its id cannot be reused while memoised
    return value


def fresh_submodules(models: Iterable[nn.Module]) -> List[nn.Module]:
    """Every submodule of ``models`` once, walked now (never memoised): what ``modules()`` yields,
    in breadth-first order, by a loop over ``_modules`` (2-3x faster than ``modules()``'s recursive
    generators; run after every pass-1 forward and before every re-run). A module class that
    overrides ``named_modules`` or ``modules`` is walked by its own method instead."""
    out: List[nn.Module] = []
    seen: Set[int] = set()
    for model in models:
        if id(model) in seen:
            continue
        seen.add(id(model))
        queue = [model]
        i = 0
        while i < len(queue):
            mod = queue[i]
            i += 1
            if _walks_itself(type(mod)):
                # its own walk (and its children's) replaces ours from here; it yields mod first
                for sub in mod.modules():
                    if sub is mod or id(sub) not in seen:
                        seen.add(id(sub))
                        out.append(sub)
                continue
            out.append(mod)
            for child in mod._modules.values():
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    queue.append(child)
    return out


@functools.lru_cache(maxsize=None)
def _overrides(cls: type, names: Tuple[str, ...]) -> bool:
    """Whether ``cls`` overrides any of ``nn.Module``'s methods ``names`` (cached per class: a class
    is not expected to change its methods after its first instance was walked; FSDP's
    ``fully_shard`` makes a new class)."""
    return any(getattr(cls, n, None) is not getattr(nn.Module, n) for n in names)


def _walks_itself(cls: type) -> bool:
    """Whether ``cls`` overrides ``named_modules`` or ``modules``."""
    return _overrides(cls, ("named_modules", "modules"))


def _lists_own_members(cls: type) -> bool:
    """Whether ``cls`` overrides how its parameters or buffers are listed (what it lists may depend
    on more than the objects it holds: such a model's walks are not carried across steps)."""
    return _overrides(cls, ("parameters", "named_parameters", "buffers", "named_buffers", "_named_members"))


_MODULES = operator.itemgetter("_modules")  # read from a module's instance __dict__ (no MRO lookup)
_BUFFERS = operator.itemgetter("_buffers")
_PARAMETERS = operator.itemgetter("_parameters")


class Structure:
    """A fresh walk of ``models`` (:func:`fresh_submodules`), and a cheap test that what it read is
    unchanged since: each module's class, ``__dict__``, ``_modules`` and ``_buffers`` dicts (the
    same objects), the children they hold (by identity, in order) and the buffer names.

    A cached step asks after every pass-1 forward and before every re-run whether a forward
    attached a module or registered a buffer (``buffers.py``): a walk and a scan of every module's
    buffers, ~1 ms of host per question for two BERT-base encoders on the GPU machine's host
    (py-spy, session 20). :meth:`unchanged` maps C-level ``len`` / ``is`` over the dicts instead
    (~3x less, with the scan it saves). It never answers "unchanged" for a tree holding
    a module that walks itself (a class overriding ``named_modules``, TorchScript: its walk may yield
    modules no ``_modules`` dict holds)."""

    def __init__(self, models: Iterable[nn.Module]) -> None:
        self.models = list(models)
        self.modules = fresh_submodules(self.models)
        self.ids = {id(m) for m in self.modules}
        self._exact = not any(_walks_itself(type(m)) or isinstance(m, torch.jit.ScriptModule)
                              or type(vars(m).get("_modules")) is not dict
                              or type(vars(m).get("_buffers")) is not dict for m in self.modules)
        if self._exact:
            # holding the modules (so every child seen) and the dicts keeps their ids from reuse
            self._types = list(map(type, self.modules))  # (a class swapped in may walk itself)
            self._attrs = list(map(vars, self.modules))
            self._module_dicts = list(map(_MODULES, self._attrs))
            self._buffer_dicts = list(map(_BUFFERS, self._attrs))
            self._child_counts = list(map(len, self._module_dicts))
            self._children = list(itertools.chain.from_iterable(map(dict.values, self._module_dicts)))
            self._buffer_counts = list(map(len, self._buffer_dicts))
            self._buffer_names = list(itertools.chain.from_iterable(self._buffer_dicts))
        self._objects: Optional[Tuple[List[Any], List[int], List[Any], List[Any], List[Any]]] = None  # (same_objects)

    def unchanged(self) -> bool:
        """No module of the walk has gained, lost or replaced a child, or a buffer name, since.
        (Every test a C-level map: ~0.15 ms for two 12-layer BERTs on this project's CPU.)"""
        if not self._exact:
            return False
        mods, attrs, module_dicts, buffer_dicts = self.modules, self._attrs, self._module_dicts, self._buffer_dicts
        is_ = operator.is_
        return (all(map(is_, map(type, mods), self._types))
                and all(map(is_, map(vars, mods), attrs))
                and all(map(is_, map(_MODULES, attrs), module_dicts))
                and all(map(is_, map(_BUFFERS, attrs), buffer_dicts))
                and list(map(len, module_dicts)) == self._child_counts
                # (same counts per dict, so the chains are of one length; children by identity)
                and all(map(is_, itertools.chain.from_iterable(map(dict.values, module_dicts)), self._children))
                and list(map(len, buffer_dicts)) == self._buffer_counts
                and list(itertools.chain.from_iterable(buffer_dicts)) == self._buffer_names)

    def walks(self, models: Sequence[nn.Module]) -> bool:
        """Whether this is a walk of exactly ``models`` (the same objects, in this order)."""
        return len(self.models) == len(models) and all(map(operator.is_, self.models, models))

    def _read_objects(self) -> Tuple[List[Any], List[int], List[Any], List[Any], List[Any]]:
        params = list(map(_PARAMETERS, self._attrs))
        return (params, list(map(len, params)), list(itertools.chain.from_iterable(params)),
                list(itertools.chain.from_iterable(map(dict.values, params))),
                list(itertools.chain.from_iterable(map(dict.values, self._buffer_dicts))))

    def same_objects(self) -> bool:
        """:meth:`unchanged`, and every module still holds the same ``_parameters`` dict, parameter
        names and objects, and buffer objects (objects by identity) as at the first call. Holds
        them until then."""
        if not self.unchanged():
            return False
        if self._objects is None:
            # parameters held in plain dicts and listed by nn.Module's own methods, or never carried
            if any(type(d.get("_parameters")) is not dict or _lists_own_members(t)
                   for d, t in zip(self._attrs, self._types)):
                return False
            self._objects = self._read_objects()
            return True
        dicts, counts, names, params, bufs = self._objects
        now_dicts, now_counts, now_names, now_params, now_bufs = self._read_objects()
        return (now_counts == counts and now_names == names and len(now_bufs) == len(bufs)
                and all(map(operator.is_, now_dicts, dicts)) and all(map(operator.is_, now_params, params))
                and all(map(operator.is_, now_bufs, bufs)))


class Carried:
    """One caller's memo (a ``GradCache``'s), carried from one step to the next while its models
    hold the same objects: the walks below then cost one :meth:`Structure.same_objects` check per
    step. Not carried: anything after a step that called :func:`forget`. (So a memoised value
    must depend only on what that check covers: classes, dicts, children, buffer names and the
    parameter and buffer objects; attributes are read by the callers, e.g. ``training``, or a
    class's compiled ``forward`` in ``engine.has_compiled_part``.)
    Between steps it holds the modules, parameters and buffers it last saw (as the memo did during
    the step): one replaced by the caller stays alive, with its ``.grad``, until the next step's
    check lets it go. Models with a class that lists its own parameters or buffers (overrides
    ``parameters()`` and the like) or holds them in another mapping than a dict are walked afresh
    at every step."""

    def __init__(self) -> None:
        self._memo: Optional[Dict[Tuple[str, int], Tuple[nn.Module, Any]]] = None
        self._structure: Optional[Structure] = None

    def take(self, models: Sequence[nn.Module]) -> Tuple[Dict[Tuple[str, int], Tuple[nn.Module, Any]], Structure]:
        """(the memo to start a step with, the :class:`Structure` of ``models`` now)."""
        s, memo = self._structure, self._memo
        self._structure = self._memo = None  # (kept again by keep() at the step's end)
        if s is not None and memo is not None and s.walks(models) and s.same_objects():
            # (only the models' own modules: a wrapper made per step, WithHead, is not carried)
            return {k: v for k, v in memo.items() if k[1] in s.ids}, s
        s = Structure(models)
        s.same_objects()  # (reads the objects, for the next step's check)
        return {}, s

    def keep(self, memo: Dict[Tuple[str, int], Tuple[nn.Module, Any]], structure: Optional[Structure]) -> None:
        self._memo, self._structure = memo, structure


def submodules(module: nn.Module) -> Tuple[nn.Module, ...]:
    """``tuple(module.modules())``: every submodule once, ``module`` first."""
    return memoised("modules", module, lambda m: tuple(m.modules()))


def parameters(module: nn.Module) -> Tuple[nn.Parameter, ...]:
    """``tuple(module.parameters())``: every parameter once."""
    return memoised("parameters", module, lambda m: tuple(m.parameters()))


def buffers(module: nn.Module) -> Tuple[Tensor, ...]:
    """``tuple(module.buffers())``: every registered (non-``None``) buffer once."""
    return memoised("buffers", module, lambda m: tuple(m.buffers()))
