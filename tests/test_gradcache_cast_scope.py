"""cast_scope.py: one autocast context from the last model of pass 1 into its re-runs.

Its weights are cast once per step (not once per pass); the gradients are bitwise those of one
context per pass (the casts are the same values, and each model's chunks accumulate in the same
order: encoders here share no parameter); backwards inside the open context run with autocast
off; an error leaves no context open; on a torch whose autocast caches graphless casts made
under no_grad (PyTorch before its fix of issue 158232) the scope is off and the cache emptied where grad-mode forwards follow."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import bigbatch
from bigbatch.gradcache import GradCache, cast_scope

BF16 = torch.bfloat16


class _Tower(nn.Module):
    """Linear layers of shapes no other tower has (so a cast is told apart by its shape), dropout."""

    def __init__(self, d_in: int, d_mid: int, d_out: int) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, d_mid)
        self.drop = nn.Dropout(0.1)
        self.b = nn.Linear(d_mid, d_out)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def _towers():
    torch.manual_seed(0)
    return _Tower(5, 11, 4), _Tower(6, 13, 4)


def _loss(q, p):
    return bigbatch.clip_loss(q.float(), p.float(), torch.tensor(5.0), backend="torch")


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 5, generator=g), torch.randn(12, 6, generator=g)


def _grads(models):
    return [p.grad.clone() for m in models for p in m.parameters()]


def _step(monkeypatch, enabled: bool, shared: bool = False):
    monkeypatch.setattr(cast_scope, "ENABLED", enabled)
    q, p = _towers()
    models = [q, q] if shared else [q, p]
    xq, xp = _inputs()
    if shared:
        xp = xp[:, :5]
    gc = GradCache(models, chunk_sizes=[5, 4], loss_fn=_loss, autocast_dtype=BF16)
    torch.manual_seed(2)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss = gc(xq, xp)
    casts = {}
    for e in prof.events():
        if e.name == "aten::_to_copy" and e.input_shapes and len(e.input_shapes[0]) == 2:
            casts[tuple(e.input_shapes[0])] = casts.get(tuple(e.input_shapes[0]), 0) + 1
    return loss, _grads([q] if shared else [q, p]), casts


def test_last_model_weights_cast_once_and_gradients_unchanged(monkeypatch):
    loss_off, grads_off, casts_off = _step(monkeypatch, False)
    loss_on, grads_on, casts_on = _step(monkeypatch, True)
    # (each count also holds one fp32 cast of the weight's gradient per chunk backward: the same)
    # query tower (first in pass 1): cast in pass 1 and again in its re-runs, either way
    assert casts_off[(11, 5)] == casts_on[(11, 5)]
    # passage tower (last in pass 1): once per pass with a context per pass, once with the scope
    assert casts_off[(13, 6)] - casts_on[(13, 6)] == 1
    assert casts_off[(4, 13)] - casts_on[(4, 13)] == 1
    assert torch.equal(loss_on, loss_off)
    for a, b in zip(grads_on, grads_off):
        assert torch.equal(a, b)


def test_shared_encoder_cast_once_per_step(monkeypatch):
    _, grads_off, casts_off = _step(monkeypatch, False, shared=True)
    _, grads_on, casts_on = _step(monkeypatch, True, shared=True)
    # off: pass 1 one context per input, pass 2 one; on: one for the step
    assert casts_off[(11, 5)] - casts_on[(11, 5)] == 2
    for a, b in zip(grads_on, grads_off):
        assert torch.equal(a, b)


def test_gradients_match_the_full_batch_under_the_scope():
    q, p = _towers()
    xq, xp = _inputs()
    torch.manual_seed(3)
    GradCache([q, p], chunk_sizes=[5, 4], loss_fn=_loss, autocast_dtype=BF16)(xq, xp)
    cached = _grads([q, p])
    for m in (q, p):
        m.zero_grad()
        m.eval()  # dropout off for the full-batch reference (the cached step's masks differ per chunk)
    torch.manual_seed(3)
    GradCache([q, p], chunk_sizes=[5, 4], loss_fn=_loss, autocast_dtype=BF16)(xq, xp)
    cached_eval = _grads([q, p])
    for m in (q, p):
        m.zero_grad()
    with torch.autocast("cpu", dtype=BF16):
        loss = _loss(q(xq), p(xp))
    loss.backward()
    full = _grads([q, p])
    for c, f in zip(cached_eval, full):
        assert torch.allclose(c, f, rtol=2e-2, atol=1e-3), (c - f).abs().max()
    assert all(c.abs().sum() > 0 for c in cached)


class _SeesAutocast(torch.autograd.Function):
    """Identity that records whether autocast was on where its backward ran."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _SeesAutocast.seen.append(torch.is_autocast_enabled("cpu"))
        return g


class _Recording(nn.Module):
    def __init__(self, d_in: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, 4)

    def forward(self, x):
        return _SeesAutocast.apply(self.lin(x))


def test_backwards_inside_the_open_context_run_without_autocast():
    """The kept chunk's backward and the loss's run while the last model's context is open: with
    autocast off, as they would outside it (a backward under autocast would re-cast its ops)."""
    torch.manual_seed(0)
    q, p = _Recording(5), _Recording(6)
    xq, xp = _inputs()
    _SeesAutocast.seen = []
    gc = GradCache([q, p], memory_budget="64GiB", loss_fn=_loss, autocast_dtype=BF16)
    gc(xq, xp)
    assert gc.last_kept_rows[1] > 0, "the budget keeps the passage tower's last chunk"
    assert _SeesAutocast.seen and not any(_SeesAutocast.seen)


def test_backward_into_inputs_that_require_grad_runs_without_autocast():
    """Inputs computed by a graph of their own (an upstream projection) get their gradient by one
    more backward after the re-runs: outside any autocast context, as from a plain step."""
    torch.manual_seed(0)
    q, p = _towers()
    xq, xp = _inputs()
    raw = xq.clone().requires_grad_()
    _SeesAutocast.seen = []
    gc = GradCache([q, p], chunk_sizes=[5, 4], loss_fn=_loss, autocast_dtype=BF16)
    gc(_SeesAutocast.apply(raw), xp)
    assert raw.grad is not None and _SeesAutocast.seen == [False]
    assert not torch.is_autocast_enabled("cpu")


def _region_step(monkeypatch, old_torch: bool):
    """A step inside the caller's own autocast region (autocast_dtype None): one weight-cast cache
    for the whole step unless it is emptied. Returns the gradients and the passage tower's casts."""
    if old_torch:
        monkeypatch.setattr(cast_scope, "gradless_casts_cached", lambda: True)
    q, p = _towers()
    xq, xp = _inputs()
    gc = GradCache([q, p], chunk_sizes=[5, 4], loss_fn=_loss)
    torch.manual_seed(2)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=BF16):
            gc(xq, xp)
    casts = sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                and tuple(e.input_shapes[0]) == (13, 6))
    monkeypatch.undo()
    return _grads([q, p]), casts


def test_on_a_torch_with_graphless_cached_casts_the_cache_is_emptied(monkeypatch):
    """Before PyTorch's fix of its issue 158232 autocast cached a cast made under no_grad without its graph and handed it
    to later grad-mode forwards of the region. There the scope is off and the cache is emptied
    before the kept chunk and between the passes: simulated (the installed torch has the fix),
    seen in the casts made again, with the same gradients."""
    assert cast_scope.gradless_casts_cached() is False  # the installed torch has the fix
    _, grads_off, casts_off = _step(monkeypatch, False)
    monkeypatch.setattr(cast_scope, "gradless_casts_cached", lambda: True)
    _, grads_old, casts_old = _step(monkeypatch, True)  # ENABLED, but the scope is not used
    # the passage tower's last chunk is kept: cast again for it (+1)
    assert casts_old[(13, 6)] == casts_off[(13, 6)] + 1
    for a, b in zip(grads_old, grads_off):
        assert torch.equal(a, b)
    monkeypatch.undo()
    grads_fixed, casts_fixed = _region_step(monkeypatch, old_torch=False)
    grads_old, casts_old = _region_step(monkeypatch, old_torch=True)
    # in a caller's region, one cast per step, unless emptied: again for the kept chunk and after pass 1
    assert casts_old == casts_fixed + 2
    for a, b in zip(grads_old, grads_fixed):
        assert torch.equal(a, b)


def test_an_error_leaves_no_autocast_context_open():
    q, p = _towers()
    xq, xp = _inputs()

    def failing(a, b):
        raise ValueError("loss failed")

    gc = GradCache([q, p], chunk_sizes=[5, 4], loss_fn=failing, autocast_dtype=BF16)
    with pytest.raises(ValueError, match="loss failed"):
        gc(xq, xp)
    assert not torch.is_autocast_enabled("cpu")
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    assert q(x).dtype == torch.float32  # no cast cache or context left behind
