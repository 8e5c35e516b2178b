"""Buffers a forward updates (BatchNorm's running statistics and batch counter, any module's
step counters) see each chunk's forward once, as in a plain chunked loop: pass 2 re-runs
forwards that pass 1 already ran, so it restores the buffers it changed. A forward that also
*reads* what it updates (``nn.utils.spectral_norm``'s power-iteration vectors, a running scale)
must see in its re-run the values its first run saw: :class:`BufferStates` keeps them per chunk.

Parameters that do not require grad may be state too: EMA codebooks and cluster sizes are often
stored as ``nn.Parameter(..., requires_grad=False)`` and updated in forward through ``.data``.
Up to ``WATCH_PARAM_BYTES`` (64 MiB) of them in all are watched, and so are the buffers when
they are not all recorded (over ``RECORD_ALL_BYTES``; a ``.data`` write bumps no version): after
each model's first chunk they are compared with a snapshot taken before the step's first forward
(a model's buffers not seen changing by then: taken again at its own first forward, after its DDP
broadcast; one host sync per device), and those it changed are recorded and restored like buffers from then
on (a copy per chunk, held until pass 2); the parameters' other snapshots are dropped. More
frozen parameters than that (a frozen tower) are taken for weights that a forward does not write.
State first written through ``.data`` by a later chunk than its model's first is not seen (keep it
in a buffer under ``RECORD_ALL_BYTES``, or write it in place without ``.data``).

With BatchNorm in training mode every chunk is normalised with its own statistics, in both
passes alike, so the gradients are exactly those of that chunked model; they are not those of
one forward over the whole batch (no chunked scheme's are).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from . import walk
from .hooks import forward_pre_hooks
from .wrappers import ddp_modules, is_ddp


# Below this many bytes of buffers in all, each chunk records every buffer (a copy each): a
# change made through ``.data`` (no autograd version bump) is then caught too. Above it (large
# constant tables), only the buffers seen changing are copied per chunk.
RECORD_ALL_BYTES = 16 * 2**20
# Up to this many bytes of parameters that do not require grad, in all, are watched for writes
# by the first chunk's forward (those written are then recorded per chunk like buffers: an EMA
# codebook); more are taken for frozen weights (a frozen tower) and never copied.
WATCH_PARAM_BYTES = 64 * 2**20

Slot = Tuple[nn.Module, str, str]  # (module, "_buffers" or "_parameters", name)


class _Marker:
    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return self.what


ABSENT = _Marker("ABSENT")  # the buffer was not registered yet: restoring removes it
PENDING = _Marker("PENDING")  # before the step's first forward
LAZY = _Marker("LAZY")  # an uninitialised (lazy) buffer: left as it is


def _buffer_slots(modules: Iterable[nn.Module], fresh: bool = False) -> List[Slot]:
    """Every buffer of ``modules`` (``None`` ones, lazily set later, included)."""
    if not fresh:
        return _slots(modules, "_buffers")
    return [(mod, "_buffers", name) for mod in walk.fresh_submodules(modules) for name in list(mod._buffers.keys())]


def _slots(modules: Iterable[nn.Module], store: str) -> List[Slot]:
    """``(module, store, name)`` of every name each submodule of ``modules`` (once each) holds in its
    ``store`` (``"_buffers"`` / ``"_parameters"``), ``None`` entries included: the names are the
    model's structure, memoised per model (``walk.py``; a forward registering one is seen by
    :meth:`BufferStates.after`, which forgets the memo)."""
    out: List[Slot] = []
    seen: Set[int] = set()
    for model in modules:
        slots = walk.memoised(store, model, lambda m: tuple((sub, store, name) for sub in walk.submodules(m)
                                                            for name in list(getattr(sub, store).keys())))
        ids = _module_ids(model)
        # (a module two models share has its slots once)
        out.extend(slots if seen.isdisjoint(ids) else [slot for slot in slots if id(slot[0]) not in seen])
        seen |= ids
    return out


def _module_ids(model: nn.Module) -> frozenset:
    """The ids of ``model``'s submodules (memoised, ``walk.py``)."""
    return walk.memoised("module ids", model, lambda m: frozenset(map(id, walk.submodules(m))))


def _state_slots(modules: Iterable[nn.Module]) -> List[Slot]:
    """Every buffer, and every parameter that does not require grad if they total at most
    ``WATCH_PARAM_BYTES`` (see the module docstring; a parameter shared by several modules counts
    once, and has a slot in each, so a re-assignment through any of them is seen)."""
    frozen = [slot for slot in _slots(modules, "_parameters") if not _trained(_get(slot))]
    distinct = {id(p): p for p in map(_get, frozen)}
    if sum(map(_nbytes, distinct.values())) > WATCH_PARAM_BYTES:
        frozen = []
    return _buffer_slots(modules) + frozen


def _changed(pairs: Sequence[Tuple[Any, Any]]) -> List[bool]:
    """For each (tensor now, snapshot before): whether it differs (values, or no longer a tensor
    of that shape). One host sync per device for all of them."""
    out: List[bool] = [True] * len(pairs)
    per_device: Dict[Any, List[Tuple[int, Tensor]]] = {}
    for j, (now, before) in enumerate(pairs):
        if isinstance(now, Tensor) and isinstance(before, Tensor) and not is_lazy(now) and now.shape == before.shape \
                and now.dtype == before.dtype and now.device == before.device:
            per_device.setdefault(now.device, []).append((j, (now.detach() != before).any()))
    for flags in per_device.values():
        for (j, _), v in zip(flags, torch.stack([f for _, f in flags]).tolist()):
            out[j] = bool(v)
    return out


def _get(slot: Slot) -> Any:
    """The slot's tensor, ``None``, or ``ABSENT`` when the name is no longer registered."""
    table = getattr(slot[0], slot[1])
    if isinstance(table, dict):
        return table.get(slot[2], ABSENT)
    return table[slot[2]] if slot[2] in table.keys() else ABSENT  # a TorchScript module's wrapper


def _copy(t: Any) -> Any:
    if t is None or t is ABSENT:
        return t
    if is_lazy(t):
        return LAZY
    return t.detach().clone()


def _put(slot: Slot, value: Any, original: Optional[Tensor]) -> None:
    """Give the buffer ``value`` (never aliased: ``value`` stays a snapshot). Copied in place, without
    an autograd version bump, only into ``original`` -- the tensor the slot held when the snapshot
    series began -- while the slot still holds it (its identity, which DDP's buffer broadcast relies
    on, is kept); a buffer that was re-assigned meanwhile may alias anything (a chunk of the
    caller's input), so it is replaced by a copy instead of written into."""
    mod, store, name = slot
    table = getattr(mod, store)
    param = store == "_parameters"
    if value is LAZY or (param and (value is None or value is ABSENT)):  # a parameter is never removed
        return
    if value is ABSENT:
        table.pop(name, None)
        return
    buf = _get(slot)
    buf = None if buf is ABSENT else buf
    if value is None:
        table[name] = None
    elif buf is not None and original is not None and buf is original and not is_lazy(buf) and buf.shape == value.shape \
            and buf.dtype == value.dtype and buf.device == value.device:
        buf.data.copy_(value)  # .data: the same storage, not the version counter
    else:
        table[name] = nn.Parameter(value.clone(), requires_grad=False) if param else value.clone()


def _trained(p: Any) -> bool:
    """A slot's parameter requires grad, or the slot is empty (``None``: nothing to watch)."""
    return p is None or p is ABSENT or p.requires_grad


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, Tensor) and not is_lazy(value) else 0


class BufferStates:
    """The buffers of ``modules`` as each pass-1 forward found them, so that its pass-2 re-run
    starts from the same values.

    ``before()`` (called where the module's own forward starts: inside a DDP wrapper, after DDP
    broadcast rank 0's buffers) returns the chunk's record; ``after()`` follows the forward. With
    at most ``RECORD_ALL_BYTES`` of buffers every record holds a copy of each; otherwise only of
    the buffers seen changing so far -- re-assigned, set or unset, or version-bumped (in-place ops
    and ``out=`` bump it; ``.data`` writes and BatchNorm's running statistics do not, and
    BatchNorm in training mode does not read them) -- and the others read their value from
    before the first chunk. A buffer a forward registers is recorded from then on (absent
    before: a re-run of an earlier chunk starts without it), and so is one deleted (absent
    after). Uninitialised (lazy) buffers are left alone: a buffer that the first forward
    materialises *and reads* in a later chunk is seen by the first chunk's re-run as pass 1 left
    it (materialise such a module with one forward first). Memory: one copy of all buffers plus
    each chunk's record."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = list(modules)
        self.slots = _state_slots(self.modules)
        self.originals = [_get(slot) for slot in self.slots]
        self.record_all = sum(_nbytes(t) for t, s in zip(self.originals, self.slots) if s[1] == "_buffers") <= RECORD_ALL_BYTES
        # frozen parameters, grouped by tensor (a parameter tied between modules has a slot in each):
        # a group is compared after the first chunk of each model owning it, until one shows it
        # written (then all its slots are recorded by every later chunk) or all of them have run
        # without writing it (then its snapshots are dropped)
        self.params = [i for i, s in enumerate(self.slots) if s[1] == "_parameters"]
        self.always: List[int] = []
        groups: Dict[int, List[int]] = {}
        for i in self.params:
            groups.setdefault(id(self.originals[i]), []).append(i)
        self._groups = list(groups.values())
        owners = [{id(sub) for sub in walk.submodules(m.module if is_ddp(m) else m)} for m in self.modules]
        self._owned = {id(m): subs for m, subs in zip(self.modules, owners)}
        self._pending = [{id(m) for m, subs in zip(self.modules, owners) if any(id(self.slots[i][0]) in subs for i in g)}
                         for g in self._groups]  # per group: the models still to run their first chunk
        self._watched_models: set = set()
        self._first_records: List[Dict[int, Any]] = []  # may share their snapshots with ``initial``
        # per slot, its value before the step's first forward, taken by that forward's in-forward
        # record (or at the end of its block if none was taken); a buffer not seen changing by the
        # time a model owning it starts its own first forward is taken again there: inside DDP that
        # is after the broadcast of rank 0's buffers, which each DDP tower runs in its own first
        # forward and which bumps no version (so the values its forwards read), while a buffer
        # already seen changing keeps the value every earlier chunk read (a model using a module
        # it does not register may write it first)
        self.initial: List[Any] = [PENDING] * len(self.slots)
        self._started: set = set()  # models whose first forward has (re)taken their buffers' initial values
        self._first_taken = False
        self._just_taken: set = set()  # the slots whose initial values this forward's record took
        self.changing: Dict[int, None] = {}  # slot indices, in the order they were seen changing
        self._marks: List[Tuple[Any, int]] = []
        # per tuple of models: the modules wrapped by DDP modules nested inside them, found once (a
        # walk over every submodule, ~0.25 ms for a BERT: per chunk it would cost a host-bound step)
        self._nested: Dict[Tuple[int, ...], Dict[int, nn.Module]] = {}
        self._module_ids = set().union(*map(_module_ids, self.modules))  # as of the last look (after())
        self._structure: Optional[walk.Structure] = None  # the last fresh walk (_unseen_buffers)
        self._structure_unseen: List[Tuple[nn.Module, str]] = []  # what it found without a slot

    def nested_ddp_modules(self, models: Sequence[nn.Module]) -> Dict[int, nn.Module]:
        """id -> module wrapped by a DDP module *inside* one of ``models`` (not a model itself)."""
        key = tuple(map(id, models))
        if key not in self._nested:
            self._nested[key] = {id(d.module): d.module for m in models for d in ddp_modules(m) if d is not m}
        return self._nested[key]

    def _mark(self) -> List[Tuple[Any, int]]:
        # the tensor itself (not its id, which a new tensor may reuse) and its version
        return [(buf, buf._version if isinstance(buf, Tensor) and not is_lazy(buf) else -1)
                for buf in map(_get, self.slots)]

    def _buffers_of(self, model_ids: Iterable[int]) -> List[int]:
        """The buffer slots of the submodules of the models with these ids."""
        subs = set().union(*(self._owned.get(m, set()) for m in model_ids))
        return [i for i, (mod, store, _) in enumerate(self.slots) if store == "_buffers" and id(mod) in subs]

    def _to_take(self, models: Sequence[nn.Module]) -> List[int]:
        """The slots whose ``initial`` value the first forward of ``models`` takes (see __init__)."""
        if not self._first_taken:  # the step's first forward: every slot
            return list(range(len(self.slots)))
        # only a model holding a DDP module needs it (its broadcast); others' buffers are as taken
        fresh = [id(m) for m in models if id(m) not in self._started and ddp_modules(m)]
        return [i for i in self._buffers_of(fresh) if i not in self.changing] if fresh else []

    def before(self, provisional: bool = False, models: Sequence[nn.Module] = ()) -> Dict[int, Any]:
        """The record of the chunk of ``models`` whose forward starts now. ``provisional``: taken
        before the forward (outside a DDP wrapper), superseded by the in-forward record when there
        is one."""
        self._marks = self._mark()
        take = self._to_take(models)
        if provisional:  # it may become the ``initial`` values of ``take``
            return {i: _copy(_get(self.slots[i])) for i in {*self._recorded(), *take}}
        for i in take:
            self.initial[i] = _copy(_get(self.slots[i]))
        self._just_taken = set(take)
        self._started |= {id(m) for m in models}
        self._first_taken = True
        # a snapshot is never written into (restore copies from it): the record may share it
        return {i: self.initial[i] if i in take else _copy(_get(self.slots[i])) for i in self._recorded()}

    def _recorded(self) -> Iterable[int]:
        """The slots each record holds."""
        params = set(self.params)
        buffers = range(len(self.slots)) if self.record_all else self.changing
        return [i for i in buffers if i not in params] + self.always

    def after(self, record: Optional[Dict[int, Any]] = None, models: Sequence[nn.Module] = ()) -> None:
        """Close the forward of ``models`` whose record is ``record`` (the first one also fixes
        ``initial``)."""
        for i in self._to_take(models):  # no in-forward record was taken: the provisional one's
            self.initial[i] = record.get(i, ABSENT) if record else ABSENT
        self._just_taken = set()
        self._started |= {id(m) for m in models}
        self._first_taken = True
        if record is not None and self.params and any(id(m) not in self._watched_models for m in models):
            self._first_records.append(record)  # a model's first: its frozen parameters' copies may go
        for i, ((now, v_now), (was, v_was)) in enumerate(zip(self._mark(), self._marks)):
            if (now is not was or v_now != v_was) and i not in self.changing:
                self.changing[i] = None  # its value before this and every earlier chunk: ``initial``
        self._watch(models)
        self._module_ids, unseen = self._unseen_buffers()
        for mod, name in unseen:  # registered by this forward: absent before it
            self.slots.append((mod, "_buffers", name))
            self.originals.append(None)
            self.initial.append(ABSENT)
            self.changing[len(self.slots) - 1] = None
        self._marks = []

    def _unseen_buffers(self) -> Tuple[Set[int], List[Tuple[nn.Module, str]]]:
        """The ids of every submodule (one fresh walk, or the last one's when its structure is
        unchanged: ``walk.Structure``), and the ``(module, name)`` of each buffer without a slot
        yet. Either changed by a forward: the step's memoised walks are dropped (``walk.forget``)."""
        if self._structure is None or not self._structure.unchanged():
            # the step's first look starts from the walk its caller carried in (walk.Carried) if
            # that still holds; later ones (a forward changed the structure) walk afresh
            seed = walk.step_structure(self.modules) if self._structure is None else None
            self._structure = seed if seed is not None and seed.unchanged() else walk.Structure(self.modules)
            candidates = [(mod, name) for mod in self._structure.modules for name in list(mod._buffers.keys())]
        else:  # the same modules and buffer names as at the last look; slots only grew since
            candidates = self._structure_unseen
        if candidates:
            known = {(id(m), n) for m, store, n in self.slots if store == "_buffers"}
            candidates = [(mod, name) for mod, name in candidates if (id(mod), name) not in known]
        self._structure_unseen = unseen = candidates
        ids = self._structure.ids
        if unseen or ids != self._module_ids:
            walk.forget()
        return ids, unseen

    def _watch(self, models: Sequence[nn.Module]) -> None:
        """After a model's first chunk: which frozen parameters did its forward write, and -- when
        buffers are not all recorded -- which of its buffers did it write without a version bump
        (``.data``)? One host sync per device for both. Those slots are recorded from now on; a
        frozen-parameter group that every owning model has run without writing has its snapshots
        dropped. (The buffers' snapshots are ``initial``, kept anyway for the earlier chunks.)"""
        large = not self.record_all
        fresh = {id(m) for m in models if id(m) not in self._watched_models} if self.params or large else set()
        if not fresh:
            return
        self._watched_models |= fresh
        check = [k for k, pending in enumerate(self._pending) if pending & fresh]
        slots = [i for k in check for i in self._groups[k]]
        quiet = [i for i in self._buffers_of(fresh) if i not in self.changing
                 and isinstance(self.initial[i], Tensor)] if large else []
        flags = _changed([(_get(self.slots[i]), self.initial[i]) for i in slots + quiet])
        changed = dict(zip(slots, flags))
        for i, written in zip(quiet, flags[len(slots):]):
            if written:
                self.changing[i] = None  # every earlier chunk read ``initial``
        for k in check:
            group = self._groups[k]
            written = any(changed[i] for i in group)  # written in place, or re-assigned through any owner
            if written:
                self.always += group
                self._pending[k] = set()
                continue
            self._pending[k] -= fresh
            if not self._pending[k]:  # every owner ran without writing it
                for i in group:
                    self.initial[i] = LAZY
                    for record in self._first_records:
                        record.pop(i, None)

    def _within(self, module: nn.Module) -> List[int]:
        """The slots of ``module``'s submodules."""
        subs = {id(m) for m in walk.submodules(module)}
        return [i for i, slot in enumerate(self.slots) if id(slot[0]) in subs]

    def retake(self, record: Dict[int, Any], module: nn.Module) -> None:
        """Where a DDP module inside a model starts (after its buffer broadcast): its buffers'
        values in ``record``, and in ``initial`` where this forward took them, are the ones now."""
        for i in self._within(module):
            if self.slots[i][1] != "_buffers":
                continue
            if i in self._just_taken:
                self.initial[i] = _copy(_get(self.slots[i]))
                if i in record:
                    record[i] = self.initial[i]
            elif i in record:
                record[i] = _copy(_get(self.slots[i]))

    def set_aside_later(self) -> List[Tuple[nn.Module, str, Any]]:
        """Remove (and return, for :meth:`put_back`) the buffers registered on these modules since the
        last pass-1 forward seen here -- by a later ``cached_encode`` / ``cached`` call of the step on a
        shared model: a re-run must not find what its first forward did not. Modules attached since
        then are left as they are (a new task's head: the re-run does not go through it)."""
        _, unseen = self._unseen_buffers()
        return [(mod, name, mod._buffers.pop(name)) for mod, name in unseen if id(mod) in self._module_ids]

    @staticmethod
    def put_back(later: List[Tuple[nn.Module, str, Any]]) -> None:
        """Undo :meth:`set_aside_later` (what a re-run registered under those names is dropped)."""
        for mod, name, value in later:
            mod._buffers[name] = value

    def restore(self, record: Dict[int, Any], within: Optional[nn.Module] = None) -> None:
        """Put the buffers back to their values before the pass-1 forward of ``record``'s chunk
        (``within``: only those of that module's submodules)."""
        mine = None if within is None else set(self._within(within))
        for i in self._recorded():
            if mine is not None and i not in mine:
                continue
            value = record[i] if i in record else self.initial[i]
            if value is not PENDING:  # (never: restore follows the step's first forward)
                _put(self.slots[i], value, self.originals[i])


@contextlib.contextmanager
def _at_forward_start(models: Sequence[nn.Module], fn: Callable[[], None], inner: Callable[[nn.Module], None],
                      nested: Dict[int, nn.Module]) -> Iterator[None]:
    """Within the block, call ``fn`` once where the first of ``models`` starts its own forward (a
    forward pre-hook; on the module a DDP model wraps, so after its buffer broadcast, which runs in
    the first forward after a synced backward), and ``inner(module)`` where the module of a DDP
    *inside* a model starts (a per-input wrapper around a DDP model, a DDP head after an encoder):
    its broadcast happens there, after the model's start, and only its own buffers change (taking
    everything there instead let modules run before it record state they had already updated).
    ``nested``: those inner DDP modules' wrapped modules (``BufferStates.nested_ddp_modules``)."""
    done = [False]

    def hook(mod: nn.Module, args: Any) -> None:
        if not done[0]:
            done[0] = True
            fn()

    # a TorchScript module takes no hooks: its record is the one taken just before its forward
    targets = [m.module if is_ddp(m) else m for m in models]
    hooks = [(m, hook, True) for m in targets if not isinstance(m, torch.jit.ScriptModule)]
    hooks += [(sub, lambda mod, args: inner(mod), True) for sub in nested.values()]
    with forward_pre_hooks(hooks):
        yield


@contextlib.contextmanager
def recording(states: BufferStates, models: Sequence[nn.Module]) -> Iterator[Dict[str, Any]]:
    """Around a pass-1 forward: yields a dict whose ``"record"`` (the chunk's) is taken on entry
    and taken again where the forward starts (what it reads); closed after the block."""
    box: Dict[str, Any] = {"record": states.before(provisional=True, models=models)}
    with _at_forward_start(models, lambda: box.update(record=states.before(models=models)),
                           lambda sub: states.retake(box["record"], sub), states.nested_ddp_modules(models)):
        try:
            yield box
        finally:
            states.after(box["record"], models)


@contextlib.contextmanager
def restoring(states: BufferStates, record: Dict[int, Any], models: Sequence[nn.Module]) -> Iterator[None]:
    """Around a pass-2 re-run: ``record`` restored before it (a module called as ``.forward()``
    runs no hooks) and again where its forward starts (a DDP broadcast there would otherwise
    replace this rank's record with rank 0's). Both copy only the recorded buffers. Buffers
    registered after the recorded forwards are absent during the block (``set_aside_later``)."""
    later = states.set_aside_later()
    try:
        states.restore(record)
        with _at_forward_start(models, lambda: states.restore(record), lambda sub: states.restore(record, within=sub),
                               states.nested_ddp_modules(models)):
            yield
    finally:
        states.put_back(later)


@contextlib.contextmanager
def buffers_restored(modules: Iterable[nn.Module]) -> Iterator[None]:
    """On exit, every buffer of ``modules`` holds its value from entry. A buffer changed in place
    is copied back in place (its identity, which DDP's buffer broadcast relies on, is kept) without
    bumping its autograd version: graphs saved before entry saw exactly the entry value, which is
    what they see again (BatchNorm's own in-place updates do not bump it either, and a version bump
    would fail such a graph's backward); a buffer the forward re-assigned, set or unset is put
    back, and one registered during the context is removed. Memory: one copy of the buffers.
    Leave the context only after the backward of what ran inside it."""
    modules = list(modules)
    saved = [(slot, _get(slot), _copy(_get(slot))) for slot in _state_slots(modules)]
    try:
        yield
    finally:
        for slot, buf, value in saved:
            _put(slot, value, buf)
        known = {(id(m), store, n) for (m, store, n), _, _ in saved}
        for mod, store, name in _buffer_slots(modules, fresh=True):  # buffers registered inside: removed
            if (id(mod), store, name) not in known:
                del mod._buffers[name]
