"""A module given as ``get_rep_fn`` (a projection head) is part of its model (``gradcache/head.py``):
its buffers, lazy initialisation, modes and parameter versions are recorded, replayed and checked
like the encoder's (17-21% off, BatchNorm statistics updated again by every re-run, before
session 12). Compared with a plain forward over the same chunks, in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch.gradcache import GradCache, cached_encode
from bigbatch.gradcache.chunking import split_batch

from helpers import assert_rel

F64 = torch.float64
CHUNK = 4


def clip(q, p):
    return bigbatch.clip_loss(q, p, 3.0)


def encoder() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8)).to(F64)


def head(kind: str) -> nn.Module:
    torch.manual_seed(3)
    if kind == "batchnorm":  # SimCLR-style
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8)).to(F64)
    if kind == "spectral_norm":
        return nn.Sequential(nn.utils.spectral_norm(nn.Linear(8, 8)), nn.Tanh()).to(F64)
    return nn.Sequential(nn.LazyLinear(8, dtype=F64), nn.Dropout(0.3))  # "lazy_dropout"


def batch():
    g = torch.Generator().manual_seed(8)
    return torch.randn(12, 6, generator=g, dtype=F64), torch.randn(12, 6, generator=g, dtype=F64)


@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
@pytest.mark.parametrize("kind", ["batchnorm", "spectral_norm", "lazy_dropout"])
def test_a_head_module_as_get_rep_fn_is_tracked_like_the_model(kind, api):
    x, y = batch()
    m, h = encoder(), head(kind)
    torch.manual_seed(5)
    clip(*[torch.cat([h(m(c)) for c in split_batch(t, CHUNK)]) for t in (x, y)]).backward()
    want = [p.grad for p in [*m.parameters(), *h.parameters()]]
    want_buffers = [b.clone() for b in h.buffers()]
    m2, h2 = encoder(), head(kind)
    torch.manual_seed(5)
    if api == "gradcache":
        GradCache(m2, CHUNK, clip, get_rep_fn=h2)(x, y)
    else:
        clip(cached_encode(m2, x, CHUNK, get_rep_fn=h2), cached_encode(m2, y, CHUNK, get_rep_fn=h2)).backward()
    for p, w in zip([*m2.parameters(), *h2.parameters()], want):
        assert_rel(p.grad, w, 1e-12, f"{kind} head via {api}")
    for b, w in zip(h2.buffers(), want_buffers):
        assert torch.equal(b, w), f"{kind} head's buffers"


def test_a_head_modified_between_cached_forward_and_backward_is_an_error():
    x, y = batch()
    m, h = encoder(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(F64)
    loss = clip(cached_encode(m, x, CHUNK, get_rep_fn=h), cached_encode(m, y, CHUNK, get_rep_fn=h))
    with torch.no_grad():
        h[0].weight.mul_(2)  # a plain graph's backward raises here too
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_the_budget_probe_leaves_a_head_batchnorm_alone():
    x, _ = batch()
    m, h, ref = encoder(), head("batchnorm"), head("batchnorm")
    cached_encode(m, x, memory_budget="100MiB", get_rep_fn=h)  # probe, then one 12-row chunk
    ref(encoder()(x))
    assert h[1].num_batches_tracked.item() == ref[1].num_batches_tracked.item() == 1
    assert torch.equal(h[1].running_mean, ref[1].running_mean)


@pytest.mark.parametrize("api", ["cached_encode", "functional"])
def test_a_cached_backward_inside_parametrize_cached_is_refused_before_any_gradient(api):
    """Its re-runs would reuse a weight cached without a graph: the documented refusal, not the
    "graph already freed" error after a first chunk had written .grad (session 12)."""
    from torch.nn.utils import parametrize

    from bigbatch.gradcache import cached

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8)).to(F64)
    parametrize.register_parametrization(m[0], "weight", nn.Identity())
    x, y = batch()
    if api == "cached_encode":
        loss = clip(cached_encode(m, x, CHUNK), cached_encode(m, y, CHUNK))
        with parametrize.cached(), pytest.raises(RuntimeError, match="parametrize.cached"):
            loss.backward()
    else:
        enc = cached(lambda model, t: model(t))
        (rx, fx), (ry, fy) = enc(m, x), enc(m, y)
        clip(rx, ry).backward()
        with parametrize.cached(), pytest.raises(RuntimeError, match="parametrize.cached"):
            fx(rx)
    assert all(p.grad is None for p in m.parameters())


def test_a_head_is_checked_like_the_model_and_hints_still_read_the_encoder():
    """A DDP(static_graph=True) head crashed inside DDP instead of the documented refusal, and the
    dict-input hint read the wrapper's (*args, **kwargs) signature (session 12, review)."""
    from bigbatch.gradcache.chunking import call_model
    from bigbatch.gradcache.head import WithHead

    class FakeStaticDDP(nn.Module):  # what check_not_fsdp reads of a DDP module, without a process group
        static_graph = True

    import bigbatch.gradcache.wrappers as wrappers

    real = wrappers.ddp_modules
    wrappers.ddp_modules = lambda m: [x for x in m.modules() if isinstance(x, FakeStaticDDP)]
    try:
        with pytest.raises(ValueError, match="static_graph"):
            GradCache(encoder(), CHUNK, clip, get_rep_fn=nn.Sequential(FakeStaticDDP(), nn.Identity()))
        with pytest.raises(ValueError, match="static_graph"):
            cached_encode(encoder(), batch()[0], CHUNK, get_rep_fn=nn.Sequential(FakeStaticDDP(), nn.Identity()))
    finally:
        wrappers.ddp_modules = real

    class TakesADict(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 8).to(F64)

        def forward(self, features):
            return self.lin(features["x"])

    with pytest.raises(TypeError, match=r"wrapped as \[inputs\]"):
        call_model(WithHead(TakesADict(), nn.Identity()), {"x": batch()[0]})
