"""Fused per-chunk gradient accumulation (gradcache/accumulate.py): the same ``.grad`` as plain
autograd accumulation, bit for bit, with one multi-tensor add per chunk instead of one per
parameter; plain accumulation wherever something observes each accumulation."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bigbatch.gradcache import GradCache, accumulate, cached_encode
from bigbatch.gradcache.accumulate import accumulating

from helpers import assert_rel

F64 = torch.float64


class Enc(nn.Module):
    def __init__(self, external: torch.Tensor = None, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=sparse)
        self.l1, self.drop, self.ln, self.l2 = nn.Linear(6, 16), nn.Dropout(0.3), nn.LayerNorm(16), nn.Linear(16, 8)
        self.external = [external]  # a leaf the forward uses, not registered as a parameter

    def forward(self, ids):
        h = self.emb(ids).sum(1)
        if self.external[0] is not None:
            h = h * self.external[0]
        return self.l2(self.ln(self.drop(torch.tanh(self.l1(h)))))


def _loss(a, b):
    return torch.nn.functional.cross_entropy(a @ b.T * 3.0, torch.arange(a.shape[0]))


def _ids(b: int, seed: int):
    return torch.randint(0, 20, (b, 5), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def _fused(on: bool):
    saved, accumulate.ENABLED = accumulate.ENABLED, on
    try:
        yield
    finally:
        accumulate.ENABLED = saved


def _step(fused: bool, pre_grad: bool, sparse: bool = False, external: bool = False):
    torch.manual_seed(0)
    ext = torch.randn(6, dtype=F64, requires_grad=True) if external else None
    mq, mp = Enc(ext, sparse).to(F64), Enc(ext, sparse).to(F64)
    params = list(mq.parameters()) + list(mp.parameters())
    if pre_grad:
        for p in params:
            p.grad = torch.randn_like(p) if not sparse or p is not mq.emb.weight else None
    torch.manual_seed(1)
    with _fused(fused):
        gc = GradCache([mq, mp], chunk_sizes=[3, 4], loss_fn=_loss)
        gc(_ids(10, 2), _ids(10, 3))
        gc(_ids(10, 4), _ids(10, 5))  # gradient accumulation over two cached steps
    return params, ext


@pytest.mark.parametrize("pre_grad", [False, True])
def test_fused_equals_plain_accumulation_bit_for_bit(pre_grad):
    fused, _ = _step(True, pre_grad)
    plain, _ = _step(False, pre_grad)
    for a, b in zip(fused, plain):
        assert a.grad is not None and torch.equal(a.grad, b.grad)


def test_existing_grad_tensor_is_kept_in_place():
    torch.manual_seed(0)
    m = Enc().to(F64)
    grads = {p: torch.zeros_like(p) for p in m.parameters()}
    for p, g in grads.items():
        p.grad = g
    GradCache(m, chunk_sizes=3, loss_fn=_loss)(_ids(8, 0), _ids(8, 1))
    for p, g in grads.items():
        assert p.grad is g and g.abs().sum() > 0


def test_a_leaf_outside_the_parameters_gets_its_full_gradient():
    fused, ext_fused = _step(True, pre_grad=True, external=True)
    plain, ext_plain = _step(False, pre_grad=True, external=True)
    assert ext_fused.grad is not None and ext_fused.grad.abs().sum() > 0
    assert_rel(ext_fused.grad, ext_plain.grad, 1e-12, "external leaf")


@pytest.mark.parametrize("pre_grad", [False, True])
def test_sparse_embedding_gradients(pre_grad):
    fused, _ = _step(True, pre_grad, sparse=True)
    plain, _ = _step(False, pre_grad, sparse=True)
    for a, b in zip(fused, plain):
        ga, gb = a.grad, b.grad
        assert ga.layout == gb.layout, "the gradient's layout changed"
        ga, gb = (ga.to_dense(), gb.to_dense()) if ga.is_sparse else (ga, gb)
        assert_rel(ga, gb, 1e-12, "sparse-embedding model")


def test_post_accumulate_hooks_see_every_accumulation():
    """A post-accumulate-grad hook (e.g. an optimizer step in backward) sees the accumulated
    ``.grad`` after each chunk, as without gradient caching's fused path."""
    torch.manual_seed(0)
    m = Enc().to(F64)
    seen = []
    m.l2.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    GradCache(m, chunk_sizes=4, loss_fn=_loss, keep_last_graph=False)(_ids(8, 0), _ids(8, 1))
    assert len(seen) == 4  # 2 inputs x 2 chunks
    assert torch.equal(seen[-1], m.l2.weight.grad)
    assert not torch.equal(seen[0], seen[-1])


def test_error_in_backward_keeps_the_gradients_set_aside():
    m = nn.Linear(3, 2).to(F64)
    g = torch.ones_like(m.weight)
    m.weight.grad = g
    with pytest.raises(RuntimeError, match="boom"):
        with accumulating() as accs:
            with accs.of(m).chunk():
                assert m.weight.grad is None
            assert m.weight.grad is None  # set aside between chunks too
            with accs.of(m).chunk():
                m.weight.grad = torch.full_like(g, 2.0)  # (what a backward accumulated before failing)
                raise RuntimeError("boom")
    assert m.weight.grad is g and torch.equal(g, torch.full_like(g, 3.0))


def test_gradients_reaching_grad_between_chunks_are_kept():
    """Between a model's chunks its ``.grad`` is set aside (``None``); a backward that runs there
    anyway (not one of the chunks') still counts: put back as the sum."""
    m = nn.Linear(3, 2).to(F64)
    x = torch.randn(4, 3, dtype=F64)
    m.weight.grad = torch.ones_like(m.weight)
    with accumulating() as accs:
        with accs.of(m).chunk():
            m(x).sum().backward()
        m(2 * x).sum().backward()  # outside any chunk
    expected = 1 + x.sum(0).expand(2, 3) * 3
    torch.testing.assert_close(m.weight.grad, expected, rtol=0, atol=1e-12)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4, dtype=F64))  # first in parameter order
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.scale.to(x.dtype)


def test_a_grad_of_another_dtype_accumulates_as_autograd_does():
    """A ``.grad`` left in another dtype than its parameter (``p.data = p.data.float()`` after a
    float64 backward) cannot be set back through ``.grad``'s setter: it is not set aside, autograd
    adds into it as in a plain step, and every other gradient is accumulated and put back (before,
    the put-back raised there and left the parameters after it without their ``.grad``)."""
    def run(cached):
        torch.manual_seed(0)
        mq, mp = _Scaled(), _Scaled()
        x, y = torch.randn(8, 4), torch.randn(8, 4)
        loss = lambda a, b: _loss(a.double(), b.double())
        loss(mq(x), mp(y)).backward()
        with torch.no_grad():
            mq.scale.data = mq.scale.data.float()  # its .grad stays float64
        if cached:
            GradCache([mq, mp], chunk_sizes=4, loss_fn=loss)(x, y)
        else:
            loss(mq(x), mp(y)).backward()
        return [(n, p.grad) for m in (mq, mp) for n, p in m.named_parameters()]

    cached, plain = run(True), run(False)
    for (n, a), (_, b) in zip(cached, plain):
        assert a is not None and a.dtype == b.dtype, n
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    assert cached[0][1].dtype == F64


def test_a_parameter_two_models_share_accumulates_through_both():
    """A parameter tied between the two encoders (an embedding): each model's accumulation sets it
    aside in turn, so its ``.grad`` sums both encoders' chunks, bit for bit as plain accumulation."""
    def step(fused):
        torch.manual_seed(0)
        mq, mp = Enc().to(F64), Enc().to(F64)
        mp.emb = mq.emb
        torch.manual_seed(1)
        with _fused(fused):
            gc = GradCache([mq, mp], chunk_sizes=[3, 4], loss_fn=_loss)
            gc(_ids(10, 2), _ids(10, 3))
            gc(_ids(10, 4), _ids(10, 5))
        return [p.grad for p in list(mq.parameters()) + list(mp.parameters())]

    fused, plain = step(True), step(False)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


class _CountAdds(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.add_, self.foreach = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.add_ += name == "add_"
        self.foreach += name == "_foreach_add_"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [True, False])
def test_one_fused_add_per_chunk_instead_of_one_per_parameter(fused):
    """What the fused path is for: the launches of accumulation. 2 chunks, ``.grad`` allocated."""
    torch.manual_seed(0)
    m = Enc().to(F64)
    n_params = len(list(m.parameters()))
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    x = _ids(8, 0)
    rep = None
    with _fused(fused):
        rep = cached_encode(m, x, chunk_size=4)
        loss = rep.square().sum()
        with _CountAdds() as count:
            loss.backward()
    if fused:
        assert count.foreach == 2 and count.add_ == 0
    else:
        assert count.foreach == 0 and count.add_ == 2 * n_params
