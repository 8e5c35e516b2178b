"""bigbatch.gradcache.functional (``cached``, ``cat_input_tensor``) against full-batch gradients.

The batch arrives in sub-batches; each is encoded without a graph and its closure later re-runs it
and back-propagates the cached representation's gradient. Reference: the same sub-batches run
*with* a graph from the same seed, one loss, one backward (the full batch with those dropout masks).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch.gradcache import cached, cat_input_tensor

from test_gradcache import TOL, check_grads, grads, make_input, make_models, params_of, zero


def clip_cat():
    @cat_input_tensor
    def loss(q, p, scale=5.0):
        return bigbatch.clip_loss(q, p, scale)

    return loss


def subbatches(seed, sizes=(3, 4, 4)):
    return [(make_input("dict", n, seed + 10 * i), make_input("tensor", n, seed + 10 * i + 1)) for i, n in enumerate(sizes)]


def reference(models, batches, seed, amp=None):
    torch.manual_seed(seed)
    qs, ps = [], []
    for x, y in batches:  # the order of the cached loop (the same random draws), one autocast context
        # per sub-batch as there (a context shared by all sub-batches would share one bf16 weight
        # copy, whose gradient autograd then accumulates in bf16)
        with torch.autocast("cpu", dtype=amp) if amp else torch.autocast("cpu", enabled=False):
            qs.append(models[0](**x))
            ps.append(models[1](y))
    loss = clip_cat()(qs, ps)  # outside autocast, as in cached_step
    loss.backward()
    return loss.detach()


def cached_step(models, batches, seed, amp=None, decorator=cached):
    @decorator
    def encode(model, x):
        return model(**x) if isinstance(x, dict) else model(x)

    torch.manual_seed(seed)
    qs, ps, closures = [], [], []
    for x, y in batches:
        ctx = torch.autocast("cpu", dtype=amp) if amp else torch.autocast("cpu", enabled=False)
        with ctx:
            rq, fq = encode(models[0], x)
            rp, fp = encode(models[1], y)
        qs.append(rq)
        ps.append(rp)
        closures += [(fq, rq), (fp, rp)]
    loss = clip_cat()(qs, ps)
    loss.backward()
    for f, r in closures:  # outside any autocast: the closure restores the first call's setting
        f(r)
    return loss.detach()


def test_exact_with_dropout_and_random_stream():
    models = make_models(2)
    params = params_of(models)
    batches = subbatches(1)
    zero(params)
    ref_loss = reference(models, batches, seed=3)
    ref = grads(params)
    after_ref = torch.rand(4)
    zero(params)
    loss = cached_step(models, batches, seed=3)
    assert torch.equal(torch.rand(4), after_ref)  # the caller's stream is where a plain pass leaves it
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    check_grads(params, ref, TOL, "functional")


def test_autocast_state_is_replayed():
    models = [m.float() for m in make_models(2)]
    params = params_of(models)
    batches = [(dict((k, v.float()) for k, v in x.items()), y.float()) for x, y in subbatches(2)]
    zero(params)
    reference(models, batches, seed=4, amp=torch.bfloat16)
    ref = grads(params)
    zero(params)
    cached_step(models, batches, seed=4, amp=torch.bfloat16)
    check_grads(params, ref, 1e-6, "functional under bf16 autocast")
    # the tolerance can tell: the same step in fp32 is far off the bf16 reference, so a closure that
    # re-ran its sub-batch without the captured bf16 setting would fail the check above
    zero(params)
    cached_step(models, batches, seed=4)
    fp32 = grads(params)
    assert max((a - b).norm() / b.norm() for a, b in zip(fp32, ref) if b.norm() > 0) > 1e-4


def test_tuple_representations_and_argument_passthrough():
    models = make_models(1)
    params = params_of(models)
    x = make_input("tensor", 6, 1)

    @cached
    def two_views(model, t, *, shift):
        h = model(t)
        return h, h + shift

    zero(params)
    torch.manual_seed(0)
    a, b, f = two_views(models[0], x, shift=1.0)  # the public package's order: reps, then the closure
    assert isinstance(a, torch.Tensor) and a.requires_grad and not a.grad_fn
    bigbatch.clip_loss(a, b, 2.0).backward()
    f((a, b))
    got = grads(params)
    zero(params)
    torch.manual_seed(0)
    h = models[0](x)
    bigbatch.clip_loss(h, h + 1.0, 2.0).backward()
    check_grads(params, got, TOL, "tuple reps")


def test_cached_representations_do_not_pin_outputs():
    model = make_models(1)[0]

    @cached
    def cls(m, t):
        return torch.stack([m(t), m(t)], dim=1)[:, 0]  # a view into a (rows, 2, D) output

    r, _ = cls(model, make_input("tensor", 5, 1))
    assert r.untyped_storage().nbytes() == r.numel() * r.element_size() and r.requires_grad


def test_misuse_is_reported():
    models = make_models(1)
    x = make_input("tensor", 5, 1)

    @cached
    def encode(model, t):
        return model(t)

    r, f = encode(models[0], x)
    with pytest.raises(RuntimeError, match="after the loss's backward"):
        f(r)
    (r * 1.0).sum().backward()
    f(r)
    with pytest.raises(RuntimeError, match="ran twice"):
        f(r)

    @cached
    def not_a_tensor(model, t):
        return model(t).tolist()

    with pytest.raises(TypeError, match="must return a tensor"):
        not_a_tensor(models[0], x)


def test_cat_input_tensor_only_concatenates_tensor_lists():
    seen = {}

    @cat_input_tensor
    def f(a, b, c, *, d):
        seen.update(a=a, b=b, c=c, d=d)

    t = torch.arange(6.0).view(3, 2)
    f([t[:1], t[1:]], 2.0, [], d=[t, t])
    assert torch.equal(seen["a"], t) and seen["b"] == 2.0 and seen["c"] == [] and seen["d"].shape == (6, 2)
    f((t, t), 2.0, [], d=(t, t))  # tuples pass as they are (a pair of weights), as in the public package
    assert isinstance(seen["a"], tuple) and isinstance(seen["d"], tuple)


def test_drop_in_for_the_public_functional_api():
    """On the CPU without AMP the public package's ``cached`` (PyPI gradcache 0.0.1) replays the
    same state, so both give the same gradients with dropout: the calls are interchangeable."""
    from gradcache.functional import cached as public_cached

    models = make_models(2)
    params = params_of(models)
    batches = subbatches(5)
    zero(params)
    cached_step(models, batches, seed=6, decorator=public_cached)
    ref = grads(params)
    zero(params)
    cached_step(models, batches, seed=6)
    check_grads(params, ref, TOL, "vs the public functional API")


@pytest.mark.parametrize("api", ["functional", "gradcache"])
def test_complex_representations_get_their_gradient(api):
    """A complex representation (ComplEx / RotatE embeddings) came back from the functional cached
    as a leaf without requires_grad (is_floating_point() is False for complex): its gradient was
    dropped silently. GradCache refused it (cached_encode took it): all three take it now."""
    class Complex(nn.Module):
        def __init__(self):
            super().__init__()
            self.re, self.im = nn.Linear(8, 6).double(), nn.Linear(8, 6).double()

        def forward(self, x):
            return self.re(x), torch.complex(self.re(x), self.im(x))

    def loss(a, z):
        return (a ** 2).mean() + (z.abs() ** 3).mean() + (z.real * z.imag).mean()

    torch.manual_seed(0)
    model = Complex()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    if api == "functional":
        loss(*ref(x)).backward()

        @cached
        def enc(m, x):
            return m(x)

        a, z, closure = enc(model, x)
        assert z.requires_grad
        loss(a, z).backward()
        closure((a, z))
    else:
        loss(torch.zeros(()), ref(x)[1]).backward()
        bigbatch.GradCache(model, 4, lambda z: loss(torch.zeros(()), z), get_rep_fn=lambda out: out[1])(x)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_a_module_inside_a_list_or_dict_argument_is_tracked():
    """Buffers, modes and parameter versions were recorded only for modules passed directly: one
    inside a list or dict re-ran with pass 1's updated BatchNorm statistics (3.2e-3 off, statistics
    counted twice)."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh()).double()

    @cached
    def direct(m, x):
        return m(x)

    @cached
    def in_list(ms, x):
        return ms[0](x)

    @cached
    def in_dict(d, x):
        return d["m"](x)

    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for how in ("direct", "list", "dict"):
        m = make()
        r, f = {"direct": lambda: direct(m, x), "list": lambda: in_list([m], x), "dict": lambda: in_dict({"m": m}, x)}[how]()
        (r ** 2).sum().backward()
        f(r)
        results.append(([p.grad.clone() for p in m.parameters()], m[1].running_mean.clone(), int(m[1].num_batches_tracked)))
    for grads_, mean, count in results[1:]:
        assert count == results[0][2] == 1
        assert torch.equal(mean, results[0][1])
        for a, b in zip(grads_, results[0][0]):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)


def test_a_closure_given_another_calls_representation_is_an_error():
    """f1(r2) ran, back-propagating r2's gradient through sub-batch 1 (17.9 off), silently."""
    m = nn.Linear(6, 4).double()

    @cached
    def enc(model, x):
        return model(x)

    x1, x2 = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    r1, f1 = enc(m, x1)
    r2, f2 = enc(m, x2)
    (r1.sum() + 2 * r2.sum()).backward()
    with pytest.raises(ValueError, match="got representation\\(s\\) its call did not return"):
        f1(r2)
    f1(r1), f2(r2)  # the right pairing still runs (the refusal spent nothing)
