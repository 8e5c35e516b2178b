"""The memory-budget probe (``gradcache/budget.py``) is invisible to the step: its made-up
gradients reach no ``.grad`` and no gradient hook, small batches are probed without one-row chunks,
a cached cost belongs to one ``get_rep_fn``, and a budget too small says by how much."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch.gradcache import GradCache, cached_encode
from bigbatch.gradcache.budget import ChunkProber, callable_key, parse_memory

from helpers import assert_rel

F64 = torch.float64


def clip(a, b):
    return bigbatch.clip_loss(a, b, 10.0)


def mlp(seed: int, width: int = 16, norm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    mid = [nn.BatchNorm1d(width)] if norm else []
    return nn.Sequential(nn.Linear(6, width), *mid, nn.Tanh(), nn.Linear(width, 8)).to(F64)


def rows(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 6, generator=g, dtype=F64), torch.randn(b, 6, generator=g, dtype=F64)


@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
def test_probe_runs_no_parameter_hook(api):
    """A summing tensor hook and a post-accumulate hook (a gradient logger) see what a plain step's
    chunks send, never the probe's gradients (3.9x off before, session 12)."""
    a, b = mlp(0), mlp(1)
    x, y = rows(11, 2)
    clip(a(x), b(y)).backward()
    ref = a[0].weight.grad.clone()
    a.zero_grad(set_to_none=True), b.zero_grad(set_to_none=True)
    seen = {"sum": torch.zeros_like(ref), "post": 0}

    def log(g):  # cached_encode's node also calls it once with None (docs/gradcache.md, Limits)
        if g is not None:
            seen["sum"] += g

    def count(p):
        if p.grad is not None:
            seen["post"] += 1

    a[0].weight.register_hook(log)
    a[0].weight.register_post_accumulate_grad_hook(count)
    if api == "gradcache":
        gc = GradCache([a, b], memory_budget="12KiB", loss_fn=clip)
        gc(x, y)
        chunks = len(gc.last_chunk_rows[0])
    else:
        clip(cached_encode(a, x, memory_budget="12KiB"), cached_encode(b, y, memory_budget="12KiB")).backward()
        chunks = None
    assert_rel(seen["sum"], ref, 1e-12, "hook's sum of the chunks' gradients")
    assert_rel(a[0].weight.grad, ref, 1e-12, ".grad")
    if chunks is not None:
        assert chunks > 1 and seen["post"] == chunks  # one per re-run chunk, none for the probe


class Checkpointed(nn.Module):
    """Reentrant activation checkpointing, which refuses ``autograd.grad``: the probe falls back to
    ``.backward()``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = mlp(seed)

    def forward(self, x):
        h = self.body[0](x)  # so the checkpointed segment's input requires grad
        return torch.utils.checkpoint.checkpoint(self.body[1:], h, use_reentrant=True)


@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
def test_reentrant_probe_leaves_an_unregistered_projection_alone(api):
    """A projection applied in ``get_rep_fn`` (not registered in the model) kept the probe's
    ones-gradients in its ``.grad`` under the reentrant fallback (5.5x off before, session 12)."""
    torch.manual_seed(3)
    proj = nn.Linear(8, 5).to(F64)
    a, b = Checkpointed(0), Checkpointed(1)
    x, y = rows(10, 4)
    get_rep = lambda out: proj(out)  # noqa: E731
    clip(get_rep(a(x)), get_rep(b(y))).backward()
    ref = [t.grad.clone() for t in (proj.weight, a.body[0].weight)]
    for t in (proj.weight, proj.bias, *a.parameters(), *b.parameters()):
        t.grad = None
    if api == "gradcache":
        GradCache([a, b], memory_budget="16KiB", loss_fn=clip, get_rep_fn=get_rep)(x, y)
    else:
        clip(cached_encode(a, x, memory_budget="16KiB", get_rep_fn=get_rep),
             cached_encode(b, y, memory_budget="16KiB", get_rep_fn=get_rep)).backward()
    assert_rel(proj.weight.grad, ref[0], 1e-12, "projection in get_rep_fn")
    assert_rel(a.body[0].weight.grad, ref[1], 1e-12, "encoder")


@pytest.mark.parametrize("b", [2, 3])
@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
def test_a_batch_of_two_or_three_rows_with_batchnorm(b, api):
    """BatchNorm in training refuses one row: the probe of a tiny batch (an epoch's last) must not
    cut one (it raised "Expected more than 1 value per channel" before, session 12)."""
    a, m = mlp(0, norm=True), mlp(1, norm=True)
    x, y = rows(b, 5)
    clip(a(x), m(y)).backward()
    ref = a[0].weight.grad.clone()
    a.zero_grad(set_to_none=True), m.zero_grad(set_to_none=True)
    if api == "gradcache":
        gc = GradCache([a, m], memory_budget="64MiB", loss_fn=clip)
        gc(x, y)
        assert gc.last_chunk_rows == [[b], [b]]
    else:
        clip(cached_encode(a, x, memory_budget="64MiB"), cached_encode(m, y, memory_budget="64MiB")).backward()
    assert_rel(a[0].weight.grad, ref, 1e-12, "BatchNorm model, tiny batch")


def test_the_probe_cache_tells_get_rep_fns_apart():
    """``cached_encode`` shares one prober across calls: a second call with a wider ``get_rep_fn``
    reused the first one's cost and planned one 512-row chunk, 1.5x over the budget (session 12)."""
    import bigbatch.gradcache.encode as encode_mod

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(F64)
    proj = nn.Linear(64, 8192).to(F64)
    x = torch.randn(512, 64, dtype=F64)
    small, wide = (lambda out: out[:, :8]), (lambda out: torch.tanh(proj(out)))
    plans = []
    real = encode_mod.split_chunks

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        plans.append([encode_mod.batch_size(c) for c in out])
        return out

    def plan(get_rep):
        plans.clear()
        model.zero_grad(set_to_none=True), proj.zero_grad(set_to_none=True)  # .grad a step creates counts
        cached_encode(model, x, memory_budget="100MiB", get_rep_fn=get_rep).sum().backward()
        return plans[0]

    prober = encode_mod._PROBER
    try:
        encode_mod.split_chunks = spy
        encode_mod._PROBER = ChunkProber()
        fresh = plan(wide)
        encode_mod._PROBER = ChunkProber()
        plan(small)
        assert plan(wide) == fresh and len(fresh) > 1
    finally:
        encode_mod.split_chunks, encode_mod._PROBER = real, prober


HEAD = nn.Linear(2, 2)
STEP = 0


def test_a_global_step_counter_does_not_re_probe_every_step():
    """A get_rep_fn reading a global int (a schedule's step) keyed the probe by its value: two extra
    forward + backward passes every step (session 12, final review); numpy numbers likewise."""
    import numpy as np

    global STEP

    def scaled(out):
        return out * min(1.0, (STEP + 1) / 10)

    keys = set()
    for STEP in range(4):
        keys.add(callable_key(scaled))
    assert len(keys) == 1

    def times(s):
        return lambda o: o * s

    def cut(k):
        return lambda o: o[:, :k]

    assert callable_key(times(np.float32(0.5))) == callable_key(times(np.float32(2)))
    assert callable_key(cut(np.int64(4))) != callable_key(cut(np.int64(8)))


def test_callable_key_is_stable_for_a_lambda_rewritten_each_step():
    """A lambda written inside a training loop is a new object each step, maybe over a per-step
    float or tensor: the same key (no new probe per step, which a key by closure ids gave)."""
    heads = [nn.Linear(2, 2), nn.Linear(2, 2)]
    keys = [callable_key(lambda out: heads[0](out)) for _ in range(3)]
    assert keys[0] == keys[1] == keys[2]

    def make(h, sigma, noise):
        return lambda out: h(out) + sigma * noise

    assert len({callable_key(make(heads[0], 0.1 * step, torch.randn(3))) for step in range(4)}) == 1


def test_callable_key_tells_apart_what_changes_memory():
    """Another module, slice width or key, through a closure, a default argument, a partial, a
    bound method's object or a rebound global, is another key (defaults and globals were ignored,
    and partials keyed by an id a freed one's successor could reuse; session 12)."""
    import functools

    global HEAD
    narrow, wide = nn.Linear(2, 2), nn.Linear(2, 64)

    def make(h):
        return lambda out: h(out)

    assert callable_key(make(narrow)) == callable_key(make(narrow))
    assert callable_key(make(narrow)) != callable_key(make(wide))
    assert callable_key(lambda o, p=narrow: p(o)) != callable_key(lambda o, p=wide: p(o))
    assert callable_key(lambda o, *, p=narrow: p(o)) != callable_key(lambda o, *, p=wide: p(o))

    def head(o, p):
        return p(o)

    assert callable_key(functools.partial(head, p=narrow)) == callable_key(functools.partial(head, p=narrow))
    assert callable_key(functools.partial(head, p=narrow)) != callable_key(functools.partial(head, p=wide))
    cut = [callable_key((lambda k: lambda o: o[:, :k])(k)) for k in (8, 8, 16)]
    assert cut[0] == cut[1] != cut[2]
    assert callable_key(narrow) != callable_key(wide)
    assert callable_key(narrow.forward) != callable_key(wide.forward)

    def global_head(o):
        return HEAD(o)

    before = callable_key(global_head)
    HEAD = nn.Linear(2, 64)
    assert callable_key(global_head) != before


def test_a_budget_too_small_for_the_representations_says_by_how_much():
    """The error named a budget larger than the need it said the budget could not hold; it now
    names what else the budget pays for and a size to go above (session 12)."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(64, 1536), nn.Tanh(), nn.Linear(1536, 100)).to(F64)
    x, y = torch.randn(2000, 64, dtype=F64), torch.randn(2000, 64, dtype=F64)
    weights = sum(p.numel() * p.element_size() for p in enc.parameters())
    reps = 2 * 2 * 2000 * 100 * 8
    with pytest.raises(ValueError, match="cannot hold the cached representations") as info:
        GradCache([enc], memory_budget=weights + reps // 2, loss_fn=clip)(x, y)
    above = parse_memory(re.search(r"well above ([0-9.]+ [KMG]iB)", str(info.value)).group(1).replace(" ", ""))
    assert above > weights + reps


def test_callable_key_of_odd_callables_is_hashable():
    """Unhashable objects reached from get_rep_fn (a dataclass config, a numpy array, a set, an
    object whose hash raises) made the probe cache's lookup raise TypeError (session 12, review)."""
    import dataclasses
    import functools
    import types

    import numpy as np

    @dataclasses.dataclass
    class Cfg:
        k: int = 4

    class BadHash:
        def __hash__(self):
            raise RuntimeError("no hash")

        def __eq__(self, other):
            raise RuntimeError("no eq")

    cfg, arr, bag, bad = Cfg(), np.arange(4), {1, 2}, BadHash()

    class Pool:
        def __call__(self, out):
            return out[:, : cfg.k]

    odd = [lambda out: out[:, : cfg.k], lambda out: out * arr.sum(), lambda out: out[:, : len(bag)],
           lambda out: out if bad else out, lambda out: types.FunctionType and out, Pool(), torch.tanh,
           functools.partial(functools.partial(torch.sum, dim=1))]
    for fn in odd:
        hash(callable_key(fn))
    torch.manual_seed(0)
    model = nn.Linear(6, 8).to(F64)
    x = torch.randn(10, 6, dtype=F64)
    out = cached_encode(model, x, memory_budget="1MiB", get_rep_fn=lambda o: o[:, : cfg.k] * arr.sum())
    assert out.shape == (10, 4)


def test_cpu_probe_does_not_charge_the_models_own_weights():
    """Autograd saves a Linear's weight (and its input) for the backward; those tensors already exist,
    so the CPU estimate must not count them as memory the step adds (it did, twice: a real
    all-MiniLM-L6-v2 probe of 7 rows charged its 41 MiB of weights, refusing budgets the step fits)."""
    import contextlib

    from bigbatch.gradcache.budget import _measure

    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh()).to(F64)
    x = torch.randn(4, 256, dtype=F64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak, act, _ = _measure(model, x, lambda out: out, contextlib.nullcontext, list(model.parameters()),
                            torch.device("cpu"))
    assert act == 4 * 256 * 8  # tanh's output only (the Linear's input is the chunk, its weight the model's)
    assert peak == 2 * act + weights  # + the gradients the step creates
