"""Buffers a forward updates (BatchNorm statistics) see each chunk once under gradient caching:
pass 2's re-runs put them back (gradcache/buffers.py). The gradients with BatchNorm in training
mode are those of the chunked model (each chunk normalised with its own statistics)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch.gradcache import GradCache, cached, cached_encode
from bigbatch.gradcache.buffers import buffers_restored
from bigbatch.gradcache.chunking import split_batch, split_rows

from test_gradcache import check_grads, grads, zero

F64 = torch.float64


def bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 12), nn.BatchNorm1d(12), nn.Dropout(0.2), nn.Tanh(), nn.Linear(12, 6)).to(F64)


def state(m: nn.Module):
    return [b.detach().clone() for b in m.buffers()]


def loss_fn(a, b):
    return bigbatch.clip_loss(a, b, 4.0)


def data(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, generator=g, dtype=F64), torch.randn(b, 5, generator=g, dtype=F64)


def reference(m, x, y, chunk: int, seed: int):
    """The same chunks (short last) in one graph: buffers updated once per chunk."""
    torch.manual_seed(seed)
    reps = [torch.cat([m(c) for c in split_batch(t, chunk)]) for t in (x, y)]
    loss_fn(*reps).backward()


@pytest.mark.parametrize("keep", [True, False])
def test_gradcache_updates_batchnorm_statistics_once_per_chunk(keep):
    x, y = data(14, 1)
    m, ref = bn_model(), bn_model()
    params, ref_params = list(m.parameters()), list(ref.parameters())
    gc = GradCache(m, chunk_sizes=4, loss_fn=loss_fn, keep_last_graph=keep)
    torch.manual_seed(3)
    gc(x, y)
    reference(ref, x, y, 4, seed=3)
    for a, b in zip(state(m), state(ref)):
        assert torch.equal(a, b) if not a.is_floating_point() else torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    assert m[1].num_batches_tracked.item() == 8  # 2 inputs x 4 chunks, not 16
    check_grads(params, grads(ref_params), 1e-10, "BatchNorm model")


def test_cached_encode_updates_batchnorm_statistics_once_per_chunk():
    x, y = data(11, 2)
    m, ref = bn_model(), bn_model()
    torch.manual_seed(4)
    loss_fn(cached_encode(m, x, 3), cached_encode(m, y, 3)).backward()
    reference(ref, x, y, 3, seed=4)
    for a, b in zip(state(m), state(ref)):
        assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-14)
    check_grads(list(m.parameters()), grads(list(ref.parameters())), 1e-10, "cached_encode, BatchNorm")


def test_functional_closure_does_not_update_buffers_again():
    m, ref = bn_model(), bn_model()

    @cached
    def encode(model, x):
        return model(x)

    x, y = data(8, 3)
    torch.manual_seed(5)
    rx, cx = encode(m, x)
    ry, cy = encode(m, y)
    after_first = state(m)
    loss_fn(rx, ry).backward()
    cx(rx)
    cy(ry)
    for a, b in zip(state(m), after_first):
        assert torch.equal(a, b)
    torch.manual_seed(5)
    loss_fn(ref(x), ref(y)).backward()
    check_grads(list(m.parameters()), grads(list(ref.parameters())), 1e-10, "functional, BatchNorm")


class Reassigns(nn.Module):
    """A forward that re-assigns its buffer (as some rotary caches do) and one that updates in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("cache", torch.zeros(3))

    def forward(self, x):
        self.steps += 1
        self.cache = torch.full((3,), float(self.steps))
        return x


def test_buffers_restored_in_place_and_reassigned():
    m = Reassigns()
    steps, cache = m.steps, m.cache
    m(torch.zeros(1))
    with buffers_restored([m, m]):  # a module listed twice is restored once
        m(torch.zeros(1))
        m(torch.zeros(1))
    assert m.steps is steps and m.steps.item() == 1.0  # in place: identity kept
    assert m.cache is not cache and torch.equal(m.cache, torch.ones(3))  # re-assigned: put back


def test_gradcache_with_batchnorm_and_a_budget_keeps_statistics():
    """The chunk-size probe and the kept graph leave the statistics as a plain chunked loop would."""
    x, y = data(40, 6)
    m = bn_model()
    gc = GradCache(m, loss_fn=loss_fn, memory_budget="40KiB")
    torch.manual_seed(7)
    gc(x, y)
    chunks = [len(r) for r in gc.last_chunk_rows]
    assert sum(chunks) > 2, gc.last_chunk_rows  # the budget forced chunks
    assert m[1].num_batches_tracked.item() == sum(chunks)
    zero(list(m.parameters()))


def test_cached_encode_beside_a_plain_forward_of_the_same_batchnorm_model():
    """The restore must not break other graphs that saved the buffers (no version bump): the
    model also encodes the keys plainly in the same loss."""
    x, y = data(11, 8)
    m, ref = bn_model(), bn_model()
    torch.manual_seed(9)
    loss_fn(cached_encode(m, x, 4), m(y)).backward()
    torch.manual_seed(9)
    rx = torch.cat([ref(c) for c in split_batch(x, 4)])
    loss_fn(rx, ref(y)).backward()
    for a, b in zip(state(m), state(ref)):
        assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-14)
    check_grads(list(m.parameters()), grads(list(ref.parameters())), 1e-10, "cached_encode + plain forward")


class RunningScale(nn.Module):
    """Reads the buffer it updates: the output depends on the running mean of earlier chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, v):
        h = self.lin(v)
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(0.5 * h.mean(0))
        return h * (1 + self.ema)


def reads_its_buffers(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "running_scale":
        return nn.Sequential(RunningScale(), nn.Dropout(0.2), nn.Tanh(), nn.Linear(6, 6)).to(F64)
    sn = nn.utils.spectral_norm if kind == "spectral_norm" else nn.utils.parametrizations.spectral_norm
    return nn.Sequential(sn(nn.Linear(5, 8)), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 6)).to(F64)


def step_with(api: str, m: nn.Module, x, y, chunk: int) -> None:
    """One cached step of ``m`` on (x, y) in chunks of ``chunk`` rows (short last) through ``api``."""
    if api.startswith("gradcache"):
        GradCache(m, chunk_sizes=chunk, loss_fn=loss_fn, keep_last_graph=api == "gradcache")(x, y)
    elif api == "cached_encode":
        loss_fn(cached_encode(m, x, chunk), cached_encode(m, y, chunk)).backward()
    else:  # the functional closures, one per chunk
        enc = cached(lambda model, v: model(v))
        outs = [(t_i, enc(m, c)) for t_i, t in enumerate((x, y)) for c in split_batch(t, chunk)]
        loss_fn(*[torch.cat([r for i, (r, _) in outs if i == side]) for side in (0, 1)]).backward()
        for _, (r, f) in outs:
            f(r)


@pytest.mark.parametrize("kind", ["running_scale", "spectral_norm", "parametrized_spectral_norm"])
@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode", "functional"])
def test_a_rerun_reads_the_buffers_its_first_run_saw(kind, api):
    """spectral_norm's power-iteration vectors are read and updated by every training forward: each
    re-run must start from the values that chunk's first forward saw, or the cached representation
    and the re-run's gradient come from different functions (rel. error 0.17 before the fix)."""
    x, y = data(11, 2)
    m, ref = reads_its_buffers(kind), reads_its_buffers(kind)
    reference(ref, x, y, 3, seed=4)
    torch.manual_seed(4)
    step_with(api, m, x, y, 3)
    for a, b in zip(state(m), state(ref)):  # and the buffers end as after one pass
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    check_grads(list(m.parameters()), grads(list(ref.parameters())), 1e-10, f"{kind} via {api}")


class DataWrittenScale(nn.Module):
    """Updates its buffer through ``.data`` (no autograd version bump), as many EMA / VQ codebook
    modules do, and reads it (a copy, so a plain loop's backward sees the value its forward used)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.register_buffer("scale", torch.ones(6))

    def forward(self, v):
        y = self.lin(v) * self.scale.clone()
        if self.training:
            self.scale.data.mul_(0.5).add_(0.5 * v.detach().abs().mean())
        return y


class LazyScale(nn.Module):
    """A buffer registered as None and created by the first forward, then re-created (a new tensor,
    which may land at the old one's id) by every later forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.register_buffer("scale", None)

    def forward(self, v):
        h = self.lin(v)
        prev = torch.ones(6, dtype=h.dtype) if self.scale is None else self.scale
        self.scale = None
        self.scale = 0.5 * prev + 0.5 * h.detach().abs().mean(0)
        return h * prev


class FrozenParamScale(DataWrittenScale):
    """The same state kept as ``nn.Parameter(..., requires_grad=False)``, as EMA codebooks often are
    (rel. error 0.38 before such parameters were recorded like buffers)."""

    def __init__(self) -> None:
        super().__init__()
        del self.scale
        self.scale = nn.Parameter(torch.ones(6), requires_grad=False)


@pytest.mark.parametrize("make", [DataWrittenScale, LazyScale, FrozenParamScale])
@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode", "functional"])
def test_buffers_written_through_data_or_created_lazily(make, api):
    m, ref = against_reference(make, api, 5, make.__name__)
    assert torch.allclose(m.scale, ref.scale, rtol=1e-12)


@pytest.mark.parametrize("make", [DataWrittenScale, LazyScale])
@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode", "functional"])
def test_buffers_written_through_data_beyond_the_record_all_size(make, api, monkeypatch):
    """Above RECORD_ALL_BYTES of buffers (a large EMA codebook) a ``.data`` write bumps no version:
    each model's first chunk is compared with the snapshot instead (0.95 off before, session 12)."""
    from bigbatch.gradcache import buffers

    monkeypatch.setattr(buffers, "RECORD_ALL_BYTES", 0)
    m, ref = against_reference(make, api, 5, f"{make.__name__} beyond the record-all size")
    assert torch.allclose(m.scale, ref.scale, rtol=1e-12)


def test_state_parameters_keep_their_identity():
    """A restored frozen parameter is written in place: optimizers and hooks keep holding it."""
    torch.manual_seed(0)
    m = FrozenParamScale().to(F64)
    held = m.scale
    x, y = data(12, 5)
    step_with("gradcache_nokeep", m, x, y, 4)
    assert m.scale is held and isinstance(m.scale, nn.Parameter) and not m.scale.requires_grad


def test_many_frozen_parameters_are_taken_for_frozen_weights(monkeypatch):
    """Beyond WATCH_PARAM_BYTES of them (a frozen tower) frozen parameters are not watched at all."""
    from bigbatch.gradcache import buffers

    m = FrozenParamScale().to(F64)
    assert any(s[1] == "_parameters" for s in buffers.BufferStates([m]).slots)
    monkeypatch.setattr(buffers, "WATCH_PARAM_BYTES", 8)
    assert not any(s[1] == "_parameters" for s in buffers.BufferStates([m]).slots)


@pytest.mark.parametrize("make", [DataWrittenScale, LazyScale, FrozenParamScale])
def test_budget_probe_changes_no_buffer(make):
    """With a budget the probe runs the model first: the step still matches its own chunks."""
    x, y = data(12, 5)
    torch.manual_seed(0)
    m, ref = make().to(F64), make().to(F64)
    ref.load_state_dict(m.state_dict())
    torch.manual_seed(1)
    gc = GradCache(m, loss_fn=loss_fn, memory_budget="3KiB")
    gc(x, y)
    assert gc.last_chunk_sizes[0] < 12
    torch.manual_seed(1)
    loss_fn(*[torch.cat([ref(c) for c in split_rows(t, r)]) for t, r in zip((x, y), gc.last_chunk_rows)]).backward()
    assert torch.allclose(m.scale, ref.scale, rtol=1e-12)
    check_grads(list(m.parameters()), grads(list(ref.parameters())), 1e-10, f"{make.__name__} with a budget")


def test_probe_leaves_a_lazy_buffer_unset():
    m = LazyScale().to(F64)
    x, _ = data(12, 5)
    from bigbatch.gradcache.budget import ChunkProber

    ChunkProber().cost(m, x, lambda o: o, contextlib.nullcontext, None)
    assert m.scale is None


class _Wrap(nn.Module):
    """A per-input wrapper around a shared DDP model."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, v):
        return self.inner(v)


def _ddp_buffer_worker(rank: int, world: int, api: str, record_all: bool):
    """The buffers drift apart across ranks (updated from each rank's data); DDP broadcasts rank 0's
    at the first forward after a synced backward, and a re-run must read what its first run read
    (after that broadcast), also when a later node's synced backward re-arms the broadcast
    (three cached_encode calls) and when only changing buffers are recorded."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bigbatch.gradcache import buffers

    if not record_all:
        buffers.RECORD_ALL_BYTES = 0
    torch.manual_seed(0)
    m = reads_its_buffers("running_scale")
    torch.manual_seed(0)
    ref = reads_its_buffers("running_scale")
    model = DDP(m, broadcast_buffers=True)
    if api == "gradcache_wrapped":  # the record must follow DDP's broadcast inside the wrapper (0.28 off)
        model, api = _Wrap(model), "gradcache"
    errs = []
    for step in range(3):
        x, y = data(8, 100 * step + rank)
        torch.manual_seed(step)
        if api == "gradcache":
            GradCache(model, chunk_sizes=4, loss_fn=loss_fn)(x, y)
        else:
            a, b, c = (cached_encode(model, t, 4) for t in (x, y, x + 1))
            (loss_fn(a, b) + loss_fn(c, b)).backward()
        for buf in ref.buffers():  # the reference: rank 0's buffers at the step start, chunks in one graph
            dist.broadcast(buf, 0)
        if api == "gradcache":
            reference(ref, x, y, 4, seed=step)
        else:
            torch.manual_seed(step)
            a, b, c = (torch.cat([ref(ch) for ch in split_batch(t, 4)]) for t in (x, y, x + 1))
            (loss_fn(a, b) + loss_fn(c, b)).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        errs.append(max(float((p.grad - q.grad).abs().max()) for p, q in zip(m.parameters(), ref.parameters())))
        for p in list(m.parameters()) + list(ref.parameters()):
            p.grad = None
    return errs


@pytest.mark.parametrize("api", ["gradcache", "cached_encode", "gradcache_wrapped"])
@pytest.mark.parametrize("record_all", [True, False])
def test_ddp_broadcast_buffers_are_what_a_rerun_reads(api, record_all):
    _exact_on_two_ranks(_ddp_buffer_worker, api, record_all)


def _exact_on_two_ranks(worker, *args) -> None:
    """``worker`` returns each step's error against the reference on its rank."""
    from distributed_harness import run_gloo

    for errs in run_gloo(worker, 2, *args):
        assert max(errs) < 1e-10, errs


class ReadsTable(nn.Module):
    """Only reads its buffer; rank 0 alone changes it between steps (a codebook re-initialised on
    rank 0), left to DDP's buffer broadcast to spread."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.register_buffer("table", torch.ones(6))

    def forward(self, v):
        return self.lin(v) * self.table


def _ddp_two_towers_worker(rank: int, world: int, kind: str, record_all: bool):
    """Two DDP towers: each broadcasts rank 0's buffers in its own first forward of a step, after
    the step's first forward (the other tower's). Each tower's re-runs must read its buffers as its
    forwards did (0.18-0.61 off at steps 1-2 before session 12, when the values before the step's
    very first forward stood for every model's)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bigbatch.gradcache import buffers

    if not record_all:
        buffers.RECORD_ALL_BYTES = 0
    make = {"data": DataWrittenScale, "inplace": RunningScale, "read": ReadsTable}[kind]

    def build(seed):
        torch.manual_seed(seed)
        return nn.Sequential(make(), nn.Tanh(), nn.Linear(6, 6)).to(F64)

    a, b, ra, rb = build(0), build(1), build(0), build(1)
    da, db = DDP(a), DDP(b)  # broadcast_buffers=True, the default
    errs = []
    for step in range(3):
        if kind == "read" and rank == 0 and step > 0:
            for m in (a, b, ra, rb):
                m[0].table.mul_(1.5)
        x, y = data(8, 100 * step + rank)
        GradCache([da, db], chunk_sizes=4, loss_fn=loss_fn)(x, y)
        for m in (ra, rb):  # the reference: rank 0's buffers at the step start, chunks in one graph
            for buf in m.buffers():
                dist.broadcast(buf, 0)
        loss_fn(*[torch.cat([m(c) for c in split_rows(t, [4, 4])]) for m, t in ((ra, x), (rb, y))]).backward()
        for p in list(ra.parameters()) + list(rb.parameters()):
            dist.all_reduce(p.grad)
            p.grad /= world
        pairs = list(zip(list(a.parameters()) + list(b.parameters()), list(ra.parameters()) + list(rb.parameters())))
        errs.append(max(float((p.grad - q.grad).abs().max() / q.grad.abs().max()) for p, q in pairs))
        for p, q in pairs:
            p.grad = q.grad = None
    return errs


@pytest.mark.parametrize("kind", ["data", "inplace", "read"])
@pytest.mark.parametrize("record_all", [True, False])
def test_ddp_two_towers_rerun_what_their_own_broadcast_gave(kind, record_all):
    _exact_on_two_ranks(_ddp_two_towers_worker, kind, record_all)


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.ones(6))


class _UsesUnregistered(nn.Module):
    """Reads and updates in place a running scale that only the *other* tower registers."""

    def __init__(self, holder: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.__dict__["holder"] = holder  # used, not registered

    def forward(self, v):
        y = self.lin(v) * self.holder.s.clone()
        with torch.no_grad():
            self.holder.s.mul_(0.5).add_(0.5 * v.abs().mean())
        return y


class _Registers(nn.Module):
    def __init__(self, holder: nn.Module) -> None:
        super().__init__()
        self.lin, self.holder = nn.Linear(5, 6), holder

    def forward(self, v):
        return self.lin(v) + self.holder.s


@pytest.mark.parametrize("keep", [True, False])
def test_a_tower_writing_a_module_only_the_other_registers(keep, monkeypatch):
    """Beyond RECORD_ALL_BYTES, tower a's re-runs must read the running scale its forwards read,
    though the scale is registered in tower b only (0.25 off in a draft of session 12's fix)."""
    from bigbatch.gradcache import buffers

    monkeypatch.setattr(buffers, "RECORD_ALL_BYTES", 0)

    def build():
        torch.manual_seed(0)
        h = _Holder()
        return _UsesUnregistered(h).to(F64), _Registers(h).to(F64)

    x, y = data(12, 3)
    ra, rb = build()
    loss_fn(*[torch.cat([m(c) for c in split_rows(t, [4, 4, 4])]) for m, t in ((ra, x), (rb, y))]).backward()
    a, b = build()
    GradCache([a, b], chunk_sizes=4, loss_fn=loss_fn, keep_last_graph=keep)(x, y)
    check_grads(list(a.parameters()) + list(b.parameters()), grads(list(ra.parameters()) + list(rb.parameters())),
                1e-10, "unregistered writer")
    assert torch.allclose(a.holder.s, ra.holder.s, rtol=1e-12)


class DropsABuffer(nn.Module):
    """Registers a scratch buffer in its first forward and deletes it in the next."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)

    def forward(self, v):
        h = self.lin(v)
        if "tmp" in self._buffers:
            out = h * (1 + self.tmp)
            del self._buffers["tmp"]
        else:
            self.register_buffer("tmp", h.detach().abs().mean(0))
            out = h
        return out


@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode", "functional"])
def test_a_buffer_deleted_by_a_forward_is_absent_again(api):
    m, ref = against_reference(DropsABuffer, api, 9, "deleted buffer")
    assert set(m._buffers) == set(ref._buffers)


def against_reference(make, api: str, data_seed: int, what: str):
    """``make()`` twice from seed 0: one model through ``api``, one in the plain chunked loop
    (4-row chunks, seed 1); their gradients must agree. Returns (model, reference model)."""
    x, y = data(12, data_seed)
    torch.manual_seed(0)
    m = make().to(F64)
    torch.manual_seed(0)
    ref = make().to(F64)
    reference(ref, x, y, 4, seed=1)
    torch.manual_seed(1)
    step_with(api, m, x, y, 4)
    check_grads(list(m.parameters()), grads(list(ref.parameters())), 1e-10, f"{what}, {api}")
    return m, ref


class RemembersItsInput(nn.Module):
    """Re-assigns a buffer to a view of its chunk (the caller's input)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.register_buffer("last", None)

    def forward(self, v):
        self.last = v.detach()
        return self.lin(v)


class CountsFromFirstCall(nn.Module):
    """Registers its buffer in the first forward, then reads and updates it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)

    def forward(self, v):
        if not hasattr(self, "step"):
            self.register_buffer("step", torch.zeros((), dtype=v.dtype))
        out = self.lin(v) * (1 + self.step)
        self.step += 0.25
        return out


@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode", "functional"])
def test_a_buffer_aliasing_the_input_never_writes_into_it(api):
    """Restoring a re-assigned buffer replaces it; it never copies into the tensor it now holds
    (here a chunk of the caller's input, which was overwritten before the fix)."""
    x, y = data(12, 6)
    x0, y0 = x.clone(), y.clone()
    torch.manual_seed(0)
    step_with(api, RemembersItsInput().to(F64), x, y, 4)
    assert torch.equal(x, x0) and torch.equal(y, y0)


@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode", "functional"])
def test_a_buffer_registered_by_the_first_forward(api):
    m, ref = against_reference(CountsFromFirstCall, api, 7, "registered in forward")
    assert torch.equal(m.step, ref.step)


class WritesItsBuffersDict(nn.Module):
    """Registers a counter by writing straight into ``_buffers`` in its first forward (no
    registration hook runs), then reads and bumps it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)

    def forward(self, v):
        h = self.lin(v)
        if "count" not in self._buffers:
            self._buffers["count"] = torch.zeros((), dtype=v.dtype)
        self.count.add_(1)
        return h * self.count.clone()


@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode", "functional"])
def test_a_buffer_written_into_the_buffers_dict_by_a_forward(api):
    """Every pass-1 forward looks for buffers it registered, however registered (a draft of session
    17 looked only when PyTorch's registration hooks had fired: 1.9 off, silently)."""
    m, ref = against_reference(WritesItsBuffersDict, api, 11, "written into _buffers")
    assert torch.equal(m.count, ref.count)


class StartsAScaleAfterWarmUp(nn.Module):
    """Registers a running scale in its fourth forward (a warm-up over: in 4-row chunks of 12 rows,
    the second input's first chunk), then reads and updates it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.register_buffer("calls", torch.zeros((), dtype=F64))

    def forward(self, v):
        self.calls.add_(1)
        h = self.lin(v)
        if self.calls.item() == 4 and not hasattr(self, "late"):
            self.register_buffer("late", torch.ones(6, dtype=F64))
        if hasattr(self, "late"):
            out = h * self.late.clone()
            self.late.mul_(0.5).add_(0.5 * h.detach().abs().mean(0))
            return out
        return h


@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode", "functional"])
def test_a_buffer_registered_by_a_later_call_is_absent_from_earlier_re_runs(api):
    """With cached_encode / cached, a later call of the step (here the second input's, or the fourth
    sub-batch) registers the buffer: the earlier calls' re-runs must not find it (0.16-0.2 off the
    plain loop before session 17: each call tracks only what it saw registered itself)."""
    m, ref = against_reference(StartsAScaleAfterWarmUp, api, 13, "registered by a later call")
    assert torch.equal(m.late, ref.late) and torch.equal(m.calls, ref.calls)


class TaskView(nn.Module):
    """One task's view of a multi-task model (cached_encode takes a module)."""

    def __init__(self, model: nn.Module, task: str) -> None:
        super().__init__()
        self.model, self.task = model, task

    def forward(self, v):
        return self.model(v, self.task)


class HeadPerTask(nn.Module):
    """A trunk and a head per task, the head (with BatchNorm) built the first time its task comes."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(5, 6)
        self.heads = nn.ModuleDict()

    def add_head(self, task: str) -> None:
        if task not in self.heads:
            self.heads[task] = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6)).to(F64)

    def forward(self, v, task: str):
        return self.heads[task](self.trunk(v))


@pytest.mark.parametrize("api", ["cached_encode", "functional"])
def test_a_head_attached_between_cached_calls_leaves_earlier_re_runs_alone(api):
    """A module attached after a cached call (a new task's head) is not in that call's re-runs'
    way: their gradients are the plain loop's (a draft of session 17's fix refused this)."""
    x, y = data(12, 15)

    def run(m, cached_api):
        torch.manual_seed(1)
        m.add_head("a")
        if not cached_api:  # the plain chunked loop
            ra = torch.cat([m(c, "a") for c in split_batch(x, 4)])
            m.add_head("b")
            loss_fn(ra, torch.cat([m(c, "b") for c in split_batch(y, 4)])).backward()
        elif api == "cached_encode":
            ra = cached_encode(TaskView(m, "a"), x, 4)
            m.add_head("b")
            loss_fn(ra, cached_encode(TaskView(m, "b"), y, 4)).backward()
        else:
            enc = cached(lambda model, v, task: model(v, task))
            outs_a = [enc(m, c, "a") for c in split_batch(x, 4)]
            m.add_head("b")
            outs_b = [enc(m, c, "b") for c in split_batch(y, 4)]
            loss_fn(torch.cat([r for r, _ in outs_a]), torch.cat([r for r, _ in outs_b])).backward()
            for r, f in outs_a + outs_b:
                f(r)

    torch.manual_seed(0)
    m = HeadPerTask().to(F64)
    torch.manual_seed(0)
    ref = HeadPerTask().to(F64)
    run(ref, cached_api=False)
    run(m, cached_api=True)
    check_grads(list(m.parameters()), grads(list(ref.parameters())), 1e-10, f"head per task, {api}")
    for a, b in zip(m.buffers(), ref.buffers()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("api", ["gradcache", "cached_encode", "functional"])
def test_lazy_modules(api):
    """Uninitialised (lazy) buffers and parameters are left to the first forward to materialise."""
    x, y = data(12, 8)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.LazyBatchNorm1d(), nn.Tanh(), nn.LazyLinear(6)).to(F64)

    m, ref = make(), make()
    reference(ref, x, y, 4, seed=1)
    torch.manual_seed(1)
    step_with(api, m, x, y, 4)
    check_grads(list(m.parameters()), grads(list(ref.parameters())), 1e-10, f"lazy modules, {api}")


class BigFrozenAndState(FrozenParamScale):
    """A 6 MiB frozen weight the forward only reads, beside the small frozen state it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 2**17), requires_grad=False)  # 6 MiB in float64

    def forward(self, v):
        return super().forward(v) + self.table[:, :1].sum() * 0.0


@pytest.mark.parametrize("api", ["gradcache_nokeep", "cached_encode", "functional"])
def test_frozen_parameters_are_watched_and_only_written_ones_recorded(api):
    """The first chunk's forward shows which frozen parameters a forward writes: only those are
    copied per chunk (the 6 MiB read-only table is not), and the written one replays exactly."""
    from bigbatch.gradcache.buffers import BufferStates, recording

    m, ref = against_reference(BigFrozenAndState, api, 7, "big frozen table + frozen state")
    assert torch.allclose(m.scale, ref.scale, rtol=1e-12)
    states = BufferStates([m])
    with recording(states, [m]):
        m(torch.randn(3, 5, dtype=F64))
    assert [states.slots[i][2] for i in states.always] == ["scale"]


@pytest.mark.parametrize("keep", [True, False])
def test_each_models_frozen_state_is_watched(keep):
    """Two models in one step: the second model's frozen state is watched after its own first
    chunk, not only the first model's (rel. error 0.19 when watching stopped after chunk 1)."""
    x, y = data(12, 8)
    torch.manual_seed(0)
    a, b = nn.Linear(5, 6).to(F64), FrozenParamScale().to(F64)
    torch.manual_seed(0)
    ra, rb = nn.Linear(5, 6).to(F64), FrozenParamScale().to(F64)
    torch.manual_seed(1)
    reps = [torch.cat([m(c) for c in split_batch(t, 4)]) for m, t in ((ra, x), (rb, y))]
    loss_fn(*reps).backward()
    torch.manual_seed(1)
    GradCache([a, b], chunk_sizes=4, loss_fn=loss_fn, keep_last_graph=keep)(x, y)
    assert torch.allclose(b.scale, rb.scale, rtol=1e-12)
    check_grads(list(a.parameters()) + list(b.parameters()), grads(list(ra.parameters()) + list(rb.parameters())),
                1e-10, "two models, frozen state in the second")


class _ReadsScale(nn.Module):
    """Reads a frozen scale it shares with another model (tied, or through a shared submodule)."""

    def __init__(self, holder: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6).to(F64)
        self.holder = holder

    def forward(self, v):
        return self.lin(v) * self.holder.scale.clone()


class _WritesScale(_ReadsScale):
    def forward(self, v):
        y = super().forward(v)
        self.holder.scale.data.mul_(0.5).add_(0.5 * v.detach().abs().mean())
        return y


@pytest.mark.parametrize("writer", ["first", "second"])
@pytest.mark.parametrize("keep", [True, False])
def test_frozen_state_shared_between_models(writer, keep):
    """One frozen parameter in a submodule both models hold, written by one of them: whichever model
    runs first, every re-run reads what its first run read (0.87 / 0.22 errors before)."""
    x, y = data(12, 9)

    def build():
        torch.manual_seed(0)
        holder = nn.Module()
        holder.scale = nn.Parameter(torch.ones(6, dtype=F64), requires_grad=False)
        first = (_WritesScale if writer == "first" else _ReadsScale)(holder)
        second = (_WritesScale if writer == "second" else _ReadsScale)(holder)
        return first, second

    a, b = build()
    ra, rb = build()
    torch.manual_seed(1)
    reps = [torch.cat([m(c) for c in split_batch(t, 4)]) for m, t in ((ra, x), (rb, y))]
    loss_fn(*reps).backward()
    torch.manual_seed(1)
    GradCache([a, b], chunk_sizes=4, loss_fn=loss_fn, keep_last_graph=keep)(x, y)
    assert torch.allclose(a.holder.scale, ra.holder.scale, rtol=1e-12)
    trained = lambda m: list(m.lin.parameters())  # noqa: E731
    check_grads(trained(a) + trained(b), grads(trained(ra) + trained(rb)), 1e-10, f"shared frozen state, {writer} writes")


class _StatefulBeforeDDP(nn.Module):
    """A stateful module (spectral norm: reads and updates its vector) runs before an inner DDP."""

    def __init__(self, ddp: nn.Module) -> None:
        super().__init__()
        self.pre = nn.utils.spectral_norm(nn.Linear(8, 8))
        self.body = ddp

    def forward(self, x):
        return self.body(self.pre(x))


def _stateful_before_ddp_worker(rank: int, world: int, where: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bigbatch.gradcache.head import WithHead

    def build():
        torch.manual_seed(0)
        if where == "wrapper":
            return _StatefulBeforeDDP(DDP(nn.Linear(8, 8).to(F64))).to(F64)
        return WithHead(nn.utils.spectral_norm(nn.Linear(8, 8)).to(F64), DDP(nn.Linear(8, 8).to(F64)))

    m, ref = build(), build()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 8, generator=g, dtype=F64), torch.randn(16, 8, generator=g, dtype=F64)
    if where == "wrapper":
        GradCache([m, m], chunk_sizes=4, loss_fn=loss_fn)(x, y)
    else:  # the DDP module as get_rep_fn: runs after the stateful encoder
        GradCache([m.model, m.model], chunk_sizes=4, loss_fn=loss_fn, get_rep_fn=m.head)(x, y)
    loss_fn(torch.cat([ref(c) for c in x.split(4)]), torch.cat([ref(c) for c in y.split(4)])).backward()
    return max(float((p.grad - q.grad).norm() / q.grad.norm()) for p, q in zip(m.parameters(), ref.parameters()))


@pytest.mark.parametrize("where", ["wrapper", "ddp_head"])
def test_state_read_before_an_inner_ddp_module_is_recorded_at_the_model_start(where):
    """Records taken where an inner DDP module starts (for its broadcast) let a spectral norm that
    runs before it record its already-updated vector: 6% off (a draft of session 12's fix)."""
    from distributed_harness import run_gloo

    assert run_gloo(_stateful_before_ddp_worker, 1, where)[0] < 1e-10
