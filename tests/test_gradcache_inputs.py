"""Encoder inputs that require grad (an adapter's output, a soft prompt, attribution) get exact
gradients through GradCache and cached_encode, also across several chunks and for a frozen
encoder; cached_encode's node takes part in ``backward(inputs=...)`` and refuses
``torch.autograd.grad`` w.r.t. encoder parameters with a clear error (gradcache/inputs.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bigbatch.gradcache import GradCache, cached_encode

from helpers import assert_rel

F64 = torch.float64


def encoder(seed: int, frozen: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8)).to(F64).requires_grad_(not frozen)


def loss_fn(q, p, temp):
    s = q @ p.T * temp
    target = torch.arange(len(q))
    return (nn.functional.cross_entropy(s, target) + nn.functional.cross_entropy(s.T, target)) / 2


def setup(frozen: bool):
    """An adapter (trainable W) before the query encoder: the encoder's input is a non-leaf."""
    g = torch.Generator().manual_seed(1)
    base, y = torch.randn(10, 6, generator=g, dtype=F64), torch.randn(10, 6, generator=g, dtype=F64)
    w = nn.Parameter(torch.eye(6, dtype=F64) + 0.1 * torch.randn(6, 6, generator=g, dtype=F64))
    temp = nn.Parameter(torch.tensor(4.0, dtype=F64))
    return base, y, w, temp, encoder(2, frozen), encoder(3, frozen)


def full(base, y, w, temp, eq, ep):
    loss_fn(eq(base @ w), ep(y), temp).backward()
    return [t.grad.clone() for t in [w, temp] + [p for p in eq.parameters() if p.requires_grad]]


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("api", ["gradcache", "gradcache_nokeep", "cached_encode"])
@pytest.mark.parametrize("chunk", [3, 10])
def test_non_leaf_input_gets_the_full_batch_gradient(frozen, api, chunk):
    """Several chunks cross the adapter's graph once (before: 'backward through the graph a second
    time' and a partial W.grad); a frozen encoder still passes gradients to its inputs (before:
    silently none)."""
    base, y, w, temp, eq, ep = setup(frozen)
    ref = full(base, y, w, temp, eq, ep)
    for t in [w, temp] + list(eq.parameters()):
        t.grad = None
    if api == "cached_encode":
        loss_fn(cached_encode(eq, base @ w, chunk), cached_encode(ep, y, chunk), temp).backward()
    else:
        GradCache([eq, ep], chunk, lambda q, p: loss_fn(q, p, temp), keep_last_graph=api == "gradcache")(base @ w, y)
    got = [w.grad, temp.grad] + [p.grad for p in eq.parameters() if p.requires_grad]
    for a, b, name in zip(got, ref, ["W", "temp", "encoder params"]):
        assert a is not None, name
        assert_rel(a, b, 1e-10, name)


@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
def test_leaf_input_that_requires_grad(api):
    base, y, _, temp, eq, ep = setup(True)
    x = base.clone().requires_grad_()
    loss_fn(eq(x), ep(y), temp).backward()
    ref, x.grad = x.grad.clone(), None
    if api == "cached_encode":
        loss_fn(cached_encode(eq, x, 4), cached_encode(ep, y, 4), temp).backward()
    else:
        GradCache([eq, ep], 4, lambda q, p: loss_fn(q, p, temp))(x, y)
    assert_rel(x.grad, ref, 1e-10, "x.grad")


def test_cached_encode_autograd_grad_wrt_inputs_of_a_frozen_encoder():
    base, y, _, temp, eq, ep = setup(True)
    x = base.clone().requires_grad_()
    ref = torch.autograd.grad(loss_fn(eq(x), ep(y), temp), [x])[0]
    got = torch.autograd.grad(loss_fn(cached_encode(eq, x, 3), ep(y), temp), [x])[0]
    assert_rel(got, ref, 1e-10, "d loss / d x")


def test_cached_encode_backward_with_inputs_restricts_the_accumulation():
    """backward(inputs=[the query encoder's params]) accumulates exactly those (before: nothing)."""
    base, y, _, temp, eq, ep = setup(False)
    loss_fn(eq(base), ep(y), temp).backward(inputs=list(eq.parameters()))
    ref = [p.grad.clone() for p in eq.parameters()]
    eq.zero_grad(set_to_none=True)
    loss_fn(cached_encode(eq, base, 4), cached_encode(ep, y, 4), temp).backward(inputs=list(eq.parameters()))
    for a, b in zip(eq.parameters(), ref):
        assert_rel(a.grad, b, 1e-10, "query encoder")
    assert all(p.grad is None for p in ep.parameters()) and temp.grad is None
    # a subset of one encoder's parameters
    eq.zero_grad(set_to_none=True)
    first = eq[0].weight
    loss_fn(cached_encode(eq, base, 4), ep(y), temp).backward(inputs=[first])
    assert_rel(first.grad, ref[0], 1e-10, "first weight")
    assert all(p.grad is None for p in eq.parameters() if p is not first)


def test_cached_encode_autograd_grad_wrt_parameters_is_a_clear_error():
    base, y, _, temp, eq, ep = setup(False)
    loss = loss_fn(cached_encode(eq, base, 4), ep(y), temp)
    with pytest.raises(RuntimeError, match="autograd.grad cannot return the encoder's parameter gradients"):
        torch.autograd.grad(loss, [eq[0].weight], retain_graph=True)
    # the refusal spends nothing: the caller's backward that follows runs (it said "backward ran twice")
    loss.backward()
    ref_q, ref_p = setup(False)[4:6]
    loss_fn(ref_q(base), ref_p(y), temp).backward()
    for p, r in zip(eq.parameters(), ref_q.parameters()):
        assert_rel(p.grad, r.grad, 1e-10, "query encoder after the refused autograd.grad")


def test_cached_encode_lists_lazy_parameters_once_materialised():
    """A LazyLinear is materialised by pass 1, which runs before the node is made: backward(inputs=
    [its weight]) reaches it (before: silently no gradient)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 6, generator=g, dtype=F64)

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LazyLinear(4)).to(F64)

    m, ref = make(), make()
    torch.manual_seed(1)
    (ref(x) ** 2).sum().backward(inputs=None)
    lazy_ref = ref[2].weight.grad.clone()
    torch.manual_seed(1)
    (cached_encode(m, x, 4) ** 2).sum().backward(inputs=[m[2].weight])
    assert_rel(m[2].weight.grad, lazy_ref, 1e-10, "lazy weight")
    assert m[0].weight.grad is None


def test_gradcache_non_leaf_input_used_by_the_loss_too():
    """The adapter's output is the encoder's input and also a term of the loss (a regulariser):
    the loss's backward crosses the adapter's graph, and the boundary's backward crosses it again
    (before: 'backward through the graph a second time' from GradCache; cached_encode was fine)."""
    base, y, w, temp, eq, ep = setup(False)
    reg = lambda f: 0.1 * f.pow(2).mean()  # noqa: E731
    f = base @ w
    (loss_fn(eq(f), ep(y), temp) + reg(f)).backward()
    ref = [t.grad.clone() for t in [w, temp] + list(eq.parameters())]
    for t in [w, temp] + list(eq.parameters()) + list(ep.parameters()):
        t.grad = None
    f = base @ w
    GradCache([eq, ep], 3, lambda q, p, aux: loss_fn(q, p, temp) + reg(aux))(f, y, aux=f)
    for a, b in zip([w.grad, temp.grad] + [p.grad for p in eq.parameters()], ref):
        assert_rel(a, b, 1e-10, "GradCache, input also in the loss")


def test_restricted_backward_leaves_unregistered_trainables_alone():
    """A frozen encoder with a trainable projection in get_rep_fn (not registered in the model),
    and torch.autograd.grad w.r.t. the input: like a plain forward, no .grad is written (before:
    the re-runs accumulated into the projection's .grad). backward(inputs=[...]) accumulates the
    named encoder parameters only (docs: Limits)."""
    g = torch.Generator().manual_seed(3)
    x, k = torch.randn(9, 6, generator=g, dtype=F64), torch.randn(9, 8, generator=g, dtype=F64)
    proj = nn.Linear(8, 8).to(F64)
    loss = lambda q: nn.functional.cross_entropy(q @ k.T, torch.arange(9))  # noqa: E731
    enc = encoder(2, frozen=True)
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(proj(enc(xr))), xr)
    xr = x.clone().requires_grad_()
    (got,) = torch.autograd.grad(loss(cached_encode(enc, xr, 4, get_rep_fn=proj)), xr)
    assert_rel(got, want, 1e-10, "input gradient")
    assert proj.weight.grad is None and proj.bias.grad is None
    enc = encoder(2)
    loss(cached_encode(enc, x, 4, get_rep_fn=proj)).backward(inputs=[enc[2].weight])
    assert enc[2].weight.grad is not None and proj.weight.grad is None and enc[0].weight.grad is None


@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
@pytest.mark.parametrize("frozen", [False, True])
def test_inputs_on_another_device_than_the_model_with_a_kept_graph(monkeypatch, api, frozen):
    """Inputs that require grad staged to the model's device (CPU inputs, a model on cuda:1): each
    chunk is a copy, which must stay in the graph. cached_encode's pass 1 runs under no_grad, and
    the kept chunk's copy was made there: its rows got a zero input gradient (a review's finding;
    on the CPU the copy to another device is emulated by a clone, which autograd records alike)."""
    from bigbatch.gradcache import chunking

    monkeypatch.setattr(chunking, "to_device", lambda x, device, non_blocking=False: chunking.map_tensors(x, torch.clone))
    base, y, w, temp, eq, ep = setup(frozen)
    ref = full(base, y, w, temp, eq, ep)
    for t in [w, temp] + list(eq.parameters()):
        t.grad = None
    if api == "cached_encode":
        q = cached_encode(eq, base @ w, 4, keep_last_graph=True)
        loss_fn(q, cached_encode(ep, y, 4, keep_last_graph=True), temp).backward()
    else:
        GradCache([eq, ep], 4, lambda q, p: loss_fn(q, p, temp), keep_last_graph=True)(base @ w, y)
    got = [w.grad, temp.grad] + [p.grad for p in eq.parameters() if p.requires_grad]
    for a, b, name in zip(got, ref, ["W", "temp", "encoder params"]):
        assert_rel(a, b, 1e-10, name)
