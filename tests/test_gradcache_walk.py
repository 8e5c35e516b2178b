"""walk.py: a model's structure walked once per cached step.

The memo (inside ``one_walk``) returns what ``modules()`` / ``parameters()`` / ``buffers()`` would,
computed once; outside it every call walks afresh; ``forget`` drops it. ``fresh_submodules`` is
``modules()``'s membership for any module tree (shared and ``None`` children, classes that walk
themselves, TorchScript). And in a GradCache step the number of walks does not grow with the
number of chunks (the host cost the memo removes); a GradCache carries its memo to its next step
while its models hold the same objects, and sees every change made between steps."""

from __future__ import annotations

import threading

import torch
from torch import nn

import bigbatch
from bigbatch.gradcache import GradCache, cached_encode
from bigbatch.gradcache import walk


class _SelfWalking(nn.Module):
    """Hides its second child from ``modules()`` (a class overriding the walk is walked by it)."""

    def __init__(self) -> None:
        super().__init__()
        self.shown = nn.Linear(2, 2)
        self.hidden = nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        memo = set() if memo is None else memo
        for name, m in (("", self), ("shown", self.shown)):
            if m not in memo:
                memo.add(m)
                yield (prefix + ("." if prefix and name else "") + name), m


class _EqualToAll(nn.Module):
    """Compares equal to any object (children must be compared by identity)."""

    def __eq__(self, other):
        return True

    __hash__ = nn.Module.__hash__


class _SelfWalkingSequential(nn.Sequential):
    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield from super().named_modules(memo, prefix, remove_duplicate)


def _trees():
    shared = nn.Linear(3, 3)
    seq = nn.Sequential(shared, nn.ReLU(), shared, nn.Sequential(nn.LayerNorm(3), shared))
    seq.add_module("nothing", None)
    other = nn.Sequential(shared, nn.Dropout())
    odd = nn.Sequential(nn.Linear(2, 2), _SelfWalking())
    scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    return [[seq], [seq, other], [other, seq, seq], [odd], [scripted], [nn.Sequential(odd, scripted)]]


def test_fresh_submodules_is_modules_membership():
    for models in _trees():
        expected = {}
        for m in models:
            for sub in m.modules():
                expected.setdefault(id(sub), sub)
        got = walk.fresh_submodules(models)
        assert len(got) == len({id(m) for m in got}), "a module listed twice"
        assert {id(m) for m in got} == set(expected), models


def test_memo_inside_one_walk_only():
    model = nn.Sequential(nn.Linear(2, 2))
    assert walk.submodules(model) is not walk.submodules(model)  # outside: a fresh walk each time
    with walk.one_walk():
        first = walk.submodules(model)
        assert walk.submodules(model) is first
        assert walk.parameters(model) is walk.parameters(model)
        assert [p for p in walk.parameters(model)] == list(model.parameters())
        with walk.one_walk():  # nested: the outer memo
            assert walk.submodules(model) is first
        model.add_module("late", nn.Linear(2, 2))
        assert walk.submodules(model) is first  # memoised: the structure as first walked ...
        walk.forget()
        assert len(walk.submodules(model)) == len(list(model.modules())) == 3  # ... until forgotten
        seen_by_thread = []
        t = threading.Thread(target=lambda: seen_by_thread.append(walk.submodules(model) is walk.submodules(model)))
        t.start()
        t.join()
        assert seen_by_thread == [False]  # the memo is per thread
    assert walk.submodules(model) is not walk.submodules(model)


def _count_walks(monkeypatch):
    """Counts top-level ``named_modules`` walks (every ``modules()`` / ``parameters()`` /
    ``buffers()`` starts one); the module's own recursion is not counted."""
    calls = [0]
    orig = nn.Module.named_modules

    def counting(self, memo=None, prefix="", remove_duplicate=True):
        if memo is None:
            calls[0] += 1
        return orig(self, memo, prefix, remove_duplicate)

    monkeypatch.setattr(nn.Module, "named_modules", counting)
    return calls


def _encoder():
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Dropout(0.1), nn.GELU(), nn.Linear(16, 8))


def test_walks_per_step_do_not_grow_with_chunks(monkeypatch):
    torch.manual_seed(0)
    mq, mp = _encoder(), _encoder()
    x, y = torch.randn(32, 8), torch.randn(32, 8)
    calls = _count_walks(monkeypatch)
    per_step = []
    for chunk in (16, 4, 2):
        cache = GradCache([mq, mp], chunk_sizes=chunk, loss_fn=lambda a, b: bigbatch.clip_loss(a, b, 10.0))
        cache(x, y)  # first step of this object (nothing per-object is planned with fixed sizes)
        calls[0] = 0
        cache(x, y)
        per_step.append(calls[0])
    # 2, 8 and 16 chunks per encoder: the same number of walks
    assert per_step[0] == per_step[1] == per_step[2], per_step
    assert per_step[0] <= 16, per_step

    calls[0] = 0
    loss = bigbatch.clip_loss(cached_encode(mq, x, 2), cached_encode(mp, y, 2), 10.0)
    loss.backward()
    few = calls[0]
    calls[0] = 0
    loss = bigbatch.clip_loss(cached_encode(mq, x, 16), cached_encode(mp, y, 16), 10.0)
    loss.backward()
    assert calls[0] == few, (few, calls[0])


class _Counting(nn.Module):
    """Registers a buffer in its first forward and counts its forwards in it (state a re-run must
    not count twice), and scales by the count of an inner BatchNorm's batches (state it reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        if "calls" not in self._buffers:
            self.register_buffer("calls", torch.zeros(()))
        self.calls += 1
        return self.norm(self.lin(x)) * (1 + self.norm.num_batches_tracked.float() / 10)


def test_memo_gives_the_unmemoised_step(monkeypatch):
    """A step whose forward registers a buffer mid-step: gradients and final buffers with the memo
    equal those with every walk made afresh (the memo is dropped when a forward changes the
    structure, so pass 2's bookkeeping sees the new buffer)."""
    results = []
    for memo in (True, False):
        torch.manual_seed(1)
        model = _Counting()
        x = torch.randn(12, 4)
        with monkeypatch.context() as mp:
            if not memo:
                mp.setattr(walk, "memoised", lambda kind, module, compute: compute(module))
            cache = GradCache([model], chunk_sizes=4, loss_fn=lambda a, b: bigbatch.clip_loss(a, b, 5.0))
            for _ in range(3):  # the second step starts with the buffer registered; the third, with its walks
                cache(x, x.flip(0))
        results.append(([p.grad.clone() for p in model.parameters()], {k: v.clone() for k, v in model.state_dict().items()}))
    (g1, s1), (g0, s0) = results
    assert s1.keys() == s0.keys() and float(s1["calls"]) == 18.0  # 6 chunks' pass-1 forwards, thrice; no re-run counted
    for k in s0:
        torch.testing.assert_close(s1[k], s0[k], rtol=0, atol=0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_forward_that_attaches_a_module_drops_the_memo():
    """buffers.py walks afresh after each pass-1 forward; when that walk finds a module or buffer
    the memo lacks, later walks of the step see the new structure."""
    from bigbatch.gradcache.buffers import BufferStates, recording

    model = nn.Sequential(nn.Linear(2, 2))
    with walk.one_walk():
        states = BufferStates([model])
        before = walk.submodules(model)
        with recording(states, [model]):
            model.add_module("attached", nn.BatchNorm1d(2))  # what a forward building on first use does
        after = walk.submodules(model)
        assert after is not before and len(after) == len(before) + 1
        assert len(walk.buffers(model)) == 3  # the new norm's running statistics and batch counter
        with recording(states, [model]):  # nothing new: the memo stays
            pass
        assert walk.submodules(model) is after


def test_structure_sees_every_change_a_forward_can_make():
    """``walk.Structure.unchanged`` (the cheap test a cached step runs after every pass-1 forward
    and before every re-run) must be False after any change of membership or buffer names --
    also raw dict writes that keep every dict's length -- and True only when nothing changed."""

    def build():
        shared = nn.Linear(3, 3)
        inner = nn.Sequential(nn.LayerNorm(3), shared)
        inner.register_buffer("b", torch.zeros(1))
        return nn.Sequential(shared, nn.ReLU(), inner), inner

    changes = {
        "add_module": lambda m, i: i.add_module("late", nn.Linear(2, 2)),
        "register_buffer": lambda m, i: i.register_buffer("late", torch.ones(1)),
        "register_none_buffer": lambda m, i: i.register_buffer("late", None),
        "raw buffer write": lambda m, i: i._buffers.__setitem__("late", torch.ones(1)),
        "buffer renamed in place": lambda m, i: (i._buffers.pop("b"), i._buffers.__setitem__("c", torch.ones(1))),
        "buffer deleted": lambda m, i: delattr(i, "b"),
        "child replaced raw": lambda m, i: m._modules.__setitem__("1", nn.Tanh()),
        "child replaced by one equal to all": lambda m, i: m._modules.__setitem__("1", _EqualToAll()),
        "__dict__ replaced": lambda m, i: object.__setattr__(i, "__dict__", {**vars(i), "_buffers": {}}),
        "class swapped to a self-walking one": lambda m, i: setattr(m, "__class__", _SelfWalkingSequential),
        "child replaced": lambda m, i: setattr(m, "1", nn.Tanh()),
        "child deleted": lambda m, i: delattr(m, "1"),
        "modules dict swapped": lambda m, i: setattr(i, "_modules", dict(i._modules)),
        "buffers dict swapped": lambda m, i: setattr(i, "_buffers", dict(i._buffers)),
    }
    for name, change in changes.items():
        model, inner = build()
        s = walk.Structure([model])
        assert s.unchanged(), name
        inner.b = torch.ones(1)  # a buffer re-assigned under its name: not a structural change
        model.train(False)
        assert s.unchanged(), name
        change(model, inner)
        assert not s.unchanged(), name
    for models in _trees():
        expected = {id(m) for mm in models for m in mm.modules()}
        s = walk.Structure(models)
        assert {id(m) for m in s.modules} == expected
        self_walking = any(isinstance(m, (_SelfWalking, torch.jit.ScriptModule)) for mm in models for m in mm.modules())
        assert s.unchanged() is not self_walking  # such trees are walked afresh every time


class _Tower(nn.Module):
    """Linear, LayerNorm, dropout, a buffer it reads, and a submodule it uses when one is attached."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.drop = nn.Dropout(0.2)
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x):
        h = self.drop(self.norm(self.lin(x) + self.shift))
        extra = self._modules.get("extra")
        return h if extra is None else extra(h)


def _between_steps():
    """Changes a caller may make between two steps (each deterministic, so two copies get the same)."""
    def new_weight(m):
        g = torch.Generator().manual_seed(7)
        m.lin.weight = nn.Parameter(torch.randn(6, 6, generator=g))

    def attach(m):
        torch.manual_seed(8)
        m.extra = nn.Linear(6, 6)

    def assign_state(m):
        state = {k: v.clone() * 0.5 for k, v in m.state_dict().items()}
        m.load_state_dict(state, assign=True)  # new Parameter objects

    return {
        "nothing": lambda m: None,
        "parameter replaced": new_weight,
        "state loaded with assign=True": assign_state,
        "module attached": attach,
        "module removed": lambda m: delattr(m, "norm") or setattr(m, "norm", nn.Identity()),
        "parameter frozen": lambda m: m.lin.bias.requires_grad_(False),
        "buffer replaced": lambda m: setattr(m, "shift", torch.ones(6)),
        "buffer registered": lambda m: m.register_buffer("late", torch.ones(1)),
        "parameters dict swapped": lambda m: setattr(m.lin, "_parameters", dict(m.lin._parameters)),
        "buffer written raw": lambda m: m._buffers.__setitem__("shift", torch.full((6,), 2.0)),
    }


def test_carried_walks_see_every_change_between_steps():
    """What ``walk.Carried`` hands a step equals a fresh walk, whatever changed since the last step
    (parameters and buffers by identity, not only the module tree)."""
    from bigbatch.gradcache.buffers import _slots

    changes = {**_between_steps(),  # (the same object under another name: the slots name it)
               "parameter renamed in place": lambda m: m.lin._parameters.__setitem__("b", m.lin._parameters.pop("bias"))}
    for name, change in changes.items():
        torch.manual_seed(0)
        model = _Tower()
        carried = walk.Carried()
        with walk.one_walk(carried, [model]):
            walk.submodules(model), walk.parameters(model), walk.buffers(model)
            _slots([model], "_parameters"), _slots([model], "_buffers")
        change(model)
        with walk.one_walk(carried, [model]):
            assert list(walk.submodules(model)) == list(model.modules()), name
            assert list(walk.parameters(model)) == list(model.parameters()), name
            for store in ("_parameters", "_buffers"):
                assert _slots([model], store) == [(m, store, n) for m in model.modules() for n in getattr(m, store)], name
            assert all(a is b for a, b in zip(walk.buffers(model), model.buffers())), name
            assert len(walk.buffers(model)) == len(list(model.buffers())), name
            reused = walk.submodules(model)
        with walk.one_walk(carried, [model]):  # nothing changed since: the same memo
            assert walk.submodules(model) is reused, name


def test_gradcache_steps_after_changes_equal_fresh_ones(monkeypatch):
    """One GradCache stepping on after a change between steps gives the gradients (bitwise) of a
    new GradCache's step after the same change; its second and later steps over unchanged models
    walk none of the models' structure again."""
    def loss_fn(a, b):
        return bigbatch.clip_loss(a, b, 5.0)

    x, y = torch.randn(12, 6), torch.randn(12, 6)
    for name, change in _between_steps().items():
        grads = []
        for carried in (True, False):
            torch.manual_seed(0)
            mq, mp = _Tower(), _Tower()
            cache = GradCache([mq, mp], chunk_sizes=4, loss_fn=loss_fn)
            cache(x, y)
            change(mp)
            for m in (mq, mp):
                m.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            (cache if carried else GradCache([mq, mp], chunk_sizes=4, loss_fn=loss_fn))(x, y)
            grads.append([(n, p.grad) for m in (mq, mp) for n, p in m.named_parameters()])
        assert [n for n, _ in grads[0]] == [n for n, _ in grads[1]], name
        for (n, a), (_, b) in zip(*grads):
            assert (a is None) == (b is None), (name, n)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name}: {n}")
    mq, mp = _Tower(), _Tower()
    cache = GradCache([mq, mp], chunk_sizes=4, loss_fn=loss_fn)
    cache(x, y)
    calls = _count_walks(monkeypatch)
    cache(x, y)
    cache(x, y)
    assert calls[0] == 0, calls[0]


class _ListsOwnParameters(nn.Linear):
    """Lists its parameters its own way (here: only while ``show`` is set)."""

    show = True

    def named_parameters(self, *args, **kwargs):
        return super().named_parameters(*args, **kwargs) if self.show else iter(())


def test_models_listing_their_own_parameters_are_walked_every_step():
    model = _ListsOwnParameters(3, 3)
    carried = walk.Carried()
    with walk.one_walk(carried, [model]):
        assert len(walk.parameters(model)) == 2
    model.show = False  # (an attribute: no object changed)
    with walk.one_walk(carried, [model]):
        assert list(walk.parameters(model)) == list(model.parameters()) == []


def test_compiling_between_steps_is_seen():
    """Whether a model has a compiled part (pass 1 then runs in grad mode) is not taken from the
    carried memo: ``module.compile()`` or a compiled ``forward`` set between steps is seen."""
    from bigbatch.gradcache.engine import has_compiled_part

    model = _Tower()
    carried = walk.Carried()
    for _ in range(2):
        with walk.one_walk(carried, [model]):
            assert not has_compiled_part(model)
    model.lin._compiled_call_impl = model.lin._call_impl  # what module.compile() sets
    with walk.one_walk(carried, [model]):
        assert has_compiled_part(model)
    model.lin._compiled_call_impl = None
    with walk.one_walk(carried, [model]):
        assert not has_compiled_part(model)
    model.norm.forward = torch.compile(model.norm.forward)
    with walk.one_walk(carried, [model]):
        assert has_compiled_part(model)
    del model.norm.forward

    class Compiled(nn.LayerNorm):
        pass

    with walk.one_walk(carried, [model]):
        assert not has_compiled_part(model)
    model.norm.__class__ = Compiled
    with walk.one_walk(carried, [model]):
        assert not has_compiled_part(model)
    Compiled.forward = torch.compile(nn.LayerNorm.forward)  # the class patched in place
    with walk.one_walk(carried, [model]):
        assert has_compiled_part(model)


def test_a_head_made_per_step_is_not_carried():
    """A module ``get_rep_fn`` is wrapped with the model in a new object every step: the carried memo
    keeps only the models' own modules, so it does not grow from step to step."""
    model, head = _Tower(), nn.Linear(6, 4)
    cache = GradCache([model, model], chunk_sizes=4, get_rep_fn=head, loss_fn=lambda a, b: bigbatch.clip_loss(a, b, 5.0))
    x = torch.randn(8, 6)
    sizes = []
    for _ in range(4):
        cache(x, x.flip(0))
        sizes.append(len(cache._walks._memo or {}))
    assert sizes[1] == sizes[2] == sizes[3], sizes
