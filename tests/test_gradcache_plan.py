"""The budget's chunk plan (``gradcache/budget.py``: ``ChunkCost``, ``ChunkProber.plan``): on CUDA
the chunk planned from the probes' two-point line is measured itself, and the cost refined through
that point, so a peak that grows slower beyond the probes (a compiled model) gets larger chunks
and one that grows faster is not planned past the budget. Simulated measurements on the CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import bigbatch
from bigbatch.gradcache import GradCache, budget, cache
from bigbatch.gradcache.budget import ChunkCost, ChunkProber


def test_refined_cost_is_piecewise_linear_through_the_measured_points():
    # the probes' line (100 + 10/row) lies above the probe's own peak at 48 rows (500 < 580)
    cost = ChunkCost(fixed=100.0, per_row=10.0, act_per_row=5.0, act_fixed=0.0, probe_rows=48,
                     probe_peak=500.0, probe_held=200.0, measured=((100, 700.0, 400.0), (200, 1000.0, 700.0)))
    assert cost.peak(20) == 300.0 and cost.peak(40) == 500.0 and cost.peak(48) == 500.0  # the line, capped
    assert cost.peak(74) == pytest.approx(600.0)  # between the probe's 500 at 48 and 700 at 100
    assert cost.peak(100) == 700.0 and cost.peak(150) == 850.0
    # beyond the last point: the steeper of its segment (3/row) and the chord from the probe (500 / 152)
    assert cost.peak(300) == pytest.approx(1000.0 + 500.0 / 152.0 * 100)
    assert cost.held(48) == 200.0 and cost.held(100) == 400.0
    assert cost.held(300) == pytest.approx(700.0 + 500.0 / 152.0 * 100)
    # a point that does not rise above the probe (allocator noise): no flat extension to any batch --
    # the line's slope beyond it
    flat = ChunkCost(fixed=100.0, per_row=10.0, act_per_row=5.0, probe_rows=48, probe_peak=580.0,
                     probe_held=240.0, measured=((100, 500.0, 100.0),))
    assert flat.peak(100) == 580.0 and flat.peak(200) == 580.0 + 10.0 * 100
    assert flat.held(200) == 240.0 + 5.0 * 100
    # with_point keeps the points ordered, one per row count, all beyond the probe
    more = cost.with_point(150, 900.0, 500.0).with_point(100, 710.0, 410.0)
    assert more.measured == ((100, 710.0, 410.0), (150, 900.0, 500.0), (200, 1000.0, 700.0))
    with pytest.raises(ValueError, match="beyond the probe's 48 rows"):
        cost.with_point(48, 1.0, 1.0)
    assert cost.near_measured(103, 0.03) and cost.near_measured(47, 0.03) and not cost.near_measured(120, 0.03)


def test_extension_beyond_the_last_point_takes_the_steeper_of_segment_and_chord():
    concave = ChunkCost(fixed=0.0, per_row=10.0, act_per_row=1.0, probe_rows=48, probe_peak=480.0,
                        probe_held=48.0, measured=((100, 900.0, 90.0), (200, 1100.0, 110.0)))
    # last segment 2/row, chord from the probe (480 at 48) 620 / 152 = 4.08/row: the chord
    assert concave.peak(300) == pytest.approx(1100.0 + 620.0 / 152.0 * 100)


@settings(max_examples=300, deadline=None)
@given(fixed=st.floats(0, 1e4), per_row=st.floats(1, 100), below=st.floats(0, 1), extra=st.lists(
    st.tuples(st.integers(49, 3000), st.floats(0, 1e5), st.floats(0, 1e5)), max_size=3),
    budget_bytes=st.integers(1, 200_000), cap=st.integers(1, 3000))
def test_largest_chunk_is_the_largest_that_fits(fixed, per_row, below, extra, budget_bytes, cap):
    probe = min(48, cap)
    cost = ChunkCost(fixed=fixed, per_row=per_row, act_per_row=1.0, probe_rows=probe,
                     probe_peak=below * (fixed + per_row * probe), probe_held=0.0)
    for rows, peak, held in extra:
        if rows > probe:
            cost = cost.with_point(rows, peak, held)
    values = [cost.peak(r) for r in range(1, cap + 1)]
    assert all(a <= b for a, b in zip(values, values[1:]))  # never falls with the rows
    assert all(cost.held(r) <= cost.peak(r) for r in (1, probe, cap))
    if values[0] > budget_bytes:
        with pytest.raises(ValueError, match="too small for even one example"):
            cost.largest_chunk(budget_bytes, cap)
        return
    assert cost.largest_chunk(budget_bytes, cap) == max(r for r, v in enumerate(values, 1) if v <= budget_bytes)


def _fake_cuda(monkeypatch, true_peak, calls):
    """``budget._measure`` returning ``true_peak(rows)`` as if on CUDA, recording the rows measured."""

    def fake_measure(model, x, get_rep, autocast_ctx, params, device, by_grad=True):
        rows = x.shape[0]
        calls.append(rows)
        return float(true_peak(rows)), 0.5 * float(true_peak(rows)), 8.0 * rows

    monkeypatch.setattr(budget, "_measure", fake_measure)
    monkeypatch.setattr(budget, "model_device", lambda m, x=None: torch.device("cuda", 0))
    monkeypatch.setattr(budget, "to_device", lambda x, d: x)
    monkeypatch.setattr(budget, "forked_rng", lambda devices: contextlib.nullcontext())


def _plan(prober: ChunkProber, b: int, budget_bytes: int, model: nn.Module = None):
    model, x = model or nn.Linear(6, 8), torch.zeros(b, 6)
    cost = prober.cost(model, x, _identity, contextlib.nullcontext, None)
    return prober.plan(model, x, _identity, contextlib.nullcontext, None, cost, budget_bytes)


def _identity(out):
    return out


def _concave(rows: int) -> float:  # 10 bytes/row up to the probe's 48 rows, 4 beyond (a compiled model)
    return 100 + 10 * rows if rows <= 48 else 580 + 4 * (rows - 48)


def _convex(rows: int) -> float:  # 20 bytes/row beyond the probe
    return 100 + 10 * rows if rows <= 48 else 580 + 20 * (rows - 48)


@pytest.mark.parametrize("curve, measured, planned", [
    # the line plans 190 rows; measured there (1,148 bytes), planned again: 403, measured at the
    # budget exactly (within the tolerance of itself: no third measurement)
    (_concave, [190, 403], 403),
    # 3,420 bytes at the line's 190 rows: planned again between 48 and 190, and measured there
    (_convex, [190, 119], 119),
], ids=["slower: larger chunks", "faster: not past the budget"])
def test_a_peak_off_the_probes_line_is_planned_from_measurements(monkeypatch, curve, measured, planned):
    calls = []
    _fake_cuda(monkeypatch, curve, calls)
    rows, cost = _plan(ChunkProber(), 1000, 2000)
    assert calls == [16, 16, 48] + measured
    assert rows == planned and curve(rows) <= 2000 < curve(rows + 1)
    assert [p[0] for p in cost.measured] == sorted(measured)


def test_the_measured_plan_is_cached_and_bounded(monkeypatch):
    calls = []
    _fake_cuda(monkeypatch, lambda r: 100 + 10 * r if r <= 48 else 580 + 200 * (r - 48) ** 0.5, calls)
    prober, model = ChunkProber(), nn.Linear(6, 8)
    first, _ = _plan(prober, 100_000, 20_000, model)
    assert len(calls) == 3 + budget._PLAN_MEASURES  # the peak keeps flattening: measured three times, no more
    calls.clear()
    again, _ = _plan(prober, 100_000, 20_000, model)  # the next step: the refined cost, nothing measured
    assert calls == [] and again == first
    calls.clear()
    _plan(prober, 100_000, 40_000, model)  # a larger budget later: no measurement left for this cost
    assert calls == []


def test_a_whole_batch_planned_as_one_chunk_is_measured_too(monkeypatch):
    calls = []
    _fake_cuda(monkeypatch, _convex, calls)
    rows, _ = _plan(ChunkProber(), 100, 2000)  # the line says all 100 rows fit; they take 1,620 bytes
    assert calls == [16, 16, 48, 100] and rows == 100
    calls.clear()
    rows, _ = _plan(ChunkProber(), 180, 2000)  # the line says all 180 fit (1,900); they take 3,220
    assert calls == [16, 16, 48, 180, 119] and rows == 119 and _convex(rows) <= 2000


def test_a_measured_point_below_the_probes_line_does_not_flatten_the_cost(monkeypatch):
    """A large fixed part (weights' gradients) lifts the probes' line above their own peaks (its
    slope guard): the knots start at the probe's measured peak, so a chunk measured below the line
    still rises, and the plan is not the whole batch (before: 1,000 rows planned for 60 that fit,
    true peak 1.33x the budget; a review's finding)."""
    calls = []
    _fake_cuda(monkeypatch, lambda r: 10_000 + 10 * r, calls)
    rows, _ = _plan(ChunkProber(), 1000, 15_000)
    assert calls[:4] == [16, 16, 48, 60] and rows == 500 and 10_000 + 10 * rows <= 15_000


def test_one_model_for_two_inputs_shares_the_refined_cost(monkeypatch):
    """Both inputs of one model and shape have one cost; the second input's plan takes up the
    points the first measured (before: it measured again from the unrefined cost and replaced the
    cached one, so the next step measured again)."""
    calls = []
    _fake_cuda(monkeypatch, _concave, calls)
    prober, model = ChunkProber(), nn.Linear(6, 8)
    cost = prober.cost(model, torch.zeros(1000, 6), _identity, contextlib.nullcontext, None)
    costs = [cost, prober.cost(model, torch.zeros(700, 6), _identity, contextlib.nullcontext, None)]
    plans = [prober.plan(model, torch.zeros(b, 6), _identity, contextlib.nullcontext, None, c, 2000)
             for b, c in zip((1000, 700), costs)]
    assert calls == [16, 16, 48, 190, 403] and [r for r, _ in plans] == [403, 403]
    calls.clear()
    again = prober.cost(model, torch.zeros(1000, 6), _identity, contextlib.nullcontext, None)
    assert prober.plan(model, torch.zeros(1000, 6), _identity, contextlib.nullcontext, None, again, 2000)[0] == 403
    assert calls == []


def test_the_cpu_estimate_is_not_measured_again(monkeypatch):
    calls = []
    _fake_cuda(monkeypatch, _concave, calls)
    monkeypatch.setattr(budget, "model_device", lambda m, x=None: torch.device("cpu"))
    rows, cost = _plan(ChunkProber(), 1000, 2000)
    assert calls == [16, 48] and rows == 190 and cost.measured == ()


def test_gradcache_chunks_follow_the_measured_plan(monkeypatch):
    """End to end: GradCache plans its chunks from the refined cost (and stays exact)."""
    calls = []
    _fake_cuda(monkeypatch, lambda r: 1000 + 10 * r if r <= 48 else 1480 + 4 * (r - 48), calls)
    monkeypatch.setattr(cache, "in_use_at_start", lambda devices, models: 0)
    torch.manual_seed(0)
    models = [nn.Linear(6, 8).double(), nn.Linear(6, 8).double()]
    x, y = torch.randn(1000, 6, dtype=torch.float64), torch.randn(1000, 6, dtype=torch.float64)

    def loss(a, b):
        return bigbatch.clip_loss(a, b, 10.0)

    # the cached representations (2 inputs x 2 x 1000 rows x the fake 8 bytes) come off the budget first
    gc = GradCache(models, loss_fn=loss, memory_budget=(4000 + 2 * 2 * 1000 * 8) / 0.95 + 1)
    value = gc(x, y)
    # both inputs probed, then planned: the line (15.4 bytes/row by its guard, 1,653 at 48 rows,
    # above the probe's 1,480) says 200 rows; measured there (2,088 bytes: 4/row from the probe),
    # 678 rows, measured at the budget exactly
    assert calls == [16, 16, 48] * 2 + [200, 678] * 2  # two models: each measured
    assert gc.last_chunk_rows == [[322, 678]] * 2
    grads = [p.grad.clone() for m in models for p in m.parameters()]
    for m in models:
        m.zero_grad()
    ref = loss(models[0](x), models[1](y))
    ref.backward()
    assert torch.allclose(value, ref, rtol=1e-12, atol=0)
    for g, m in zip(grads, [p for m in models for p in m.parameters()]):
        assert torch.allclose(g, m.grad, rtol=1e-10, atol=1e-12)


def test_the_default_cuda_budget_counts_the_allocators_unused_blocks(monkeypatch):
    """The device reports the blocks PyTorch's caching allocator holds as taken; after a first step
    they were left out, and the default budget collapsed (a review's simulation: 127 -> 20 GiB on a
    141 GiB GPU, chunks 2,411 -> 330 rows)."""
    from bigbatch.gradcache import cache

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 141 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 124 * gib)  # 120 GiB held unused
    assert cache.default_budget(torch.device("cuda", 0)) == 4 * gib + int(130 * gib * 0.9)
