"""clip_loss / infonce_loss on the CPU backends ("reference", "torch" tiles) against float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bigbatch
from bigbatch import reference
from bigbatch.backends import TorchTiles

from helpers import TRITON_DEVICE, assert_close, assert_rel, features, rel_err

BACKENDS = ["reference", "torch", TorchTiles(tile_rows=7, tile_cols=5)]
BACKEND_IDS = ["reference", "torch-auto-tile", "torch-7x5"]


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def _assert_loss(loss, ref, scale: float, rows: int, tol: float = 2e-5):
    """Relative error <= tol, or an absolute error at fp32 rounding of the logits: the loss is
    ``lse - positive logit`` and a loss far below ulp(logit) (~1e-7 * scale) cannot be relatively exact
    in fp32 (the gradients, built from the probabilities, are unaffected and checked relatively)."""
    err = (loss.double() - ref.double()).abs().max().item()
    assert err <= tol * ref.double().abs().max().item() + 1e-6 * scale * rows, f"loss: abs error {err:.3e}"


def _clip_ref64(q, k, scale):
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    s64 = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    loss = reference.clip_loss(q64, k64, s64)
    return (loss, *_grads(loss, (q64, k64, s64)))


def _loops_infonce(q, k, scale, labels):
    """The definition in plain Python: per query row, log(sum_j exp(s * q_i.k_j)) - s * q_i.k_label."""
    out = []
    for i in range(len(q)):
        logits = [scale * sum(a * b for a, b in zip(q[i], k[j])) for j in range(len(k))]
        top = max(logits)
        out.append(top + math.log(sum(math.exp(x - top) for x in logits)) - logits[labels[i]])
    return out


def test_the_reference_is_the_definition():
    """reference.py is the truth the other tests compare to: checked here against the definition
    written out in plain Python (no torch ops), so that an error in it cannot hide behind a test
    comparing it with itself; its gradients against finite differences (gradcheck)."""
    g = torch.Generator().manual_seed(11)
    b, n, d, scale = 5, 8, 3, 2.5
    q, k = torch.randn(b, d, generator=g, dtype=torch.float64), torch.randn(n, d, generator=g, dtype=torch.float64)
    labels = torch.tensor([3, 0, 7, 7, 1])
    rows = _loops_infonce(q.tolist(), k.tolist(), scale, labels.tolist())
    got = reference.infonce_loss(q, k, scale, labels=labels, reduction="none")
    assert torch.allclose(got, torch.tensor(rows, dtype=torch.float64), rtol=1e-13, atol=0)
    assert math.isclose(reference.infonce_loss(q, k, scale, labels=labels).item(), sum(rows) / b, rel_tol=1e-13)
    a, t = q, k[:b]
    i2t = _loops_infonce(a.tolist(), t.tolist(), scale, list(range(b)))
    t2i = _loops_infonce(t.tolist(), a.tolist(), scale, list(range(b)))
    assert math.isclose(reference.clip_loss(a, t, scale).item(), (sum(i2t) + sum(t2i)) / (2 * b), rel_tol=1e-13)
    s = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    a, t = a.clone().requires_grad_(), t.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, y, z: reference.clip_loss(x, y, z), (a, t, s))
    assert torch.autograd.gradcheck(lambda x, y, z: reference.infonce_loss(x, y, z, labels=labels),
                                    (a, k.clone().requires_grad_(), s))


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_clip_matches_float64(backend, dtype, tol):
    q, k = features(53, 19, dtype=dtype, seed=1), features(53, 19, dtype=dtype, seed=2)
    scale = torch.tensor(13.7, dtype=dtype, requires_grad=True)
    loss = bigbatch.clip_loss(q, k, scale, backend=backend)
    dq, dk, ds = _grads(loss, (q, k, scale))
    ref = _clip_ref64(q, k, 13.7)
    for got, want, what in zip((loss, dq, dk, ds), ref, ("loss", "dq", "dk", "dscale")):
        assert_rel(got, want, tol, what)
    assert dq.dtype == dtype and dk.dtype == dtype and ds.dtype == dtype


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 300),
    d=st.integers(1, 200),
    tile_rows=st.integers(1, 96),
    tile_cols=st.integers(1, 96),
    scale=st.floats(0.1, 100.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_clip_tiles_property(b, d, tile_rows, tile_cols, scale, seed):
    """Any B, D and tile shape (dividing B or not) gives the float64 loss and gradients."""
    q, k = features(b, d, seed=seed), features(b, d, seed=seed + 1)
    s = torch.tensor(scale, requires_grad=True)
    loss = bigbatch.clip_loss(q, k, s, backend=TorchTiles(tile_rows=tile_rows, tile_cols=tile_cols))
    dq, dk, ds = _grads(loss, (q, k, s))
    ref = _clip_ref64(q, k, scale)
    _assert_loss(loss, ref[0], scale, 1)
    # Floors at fp32 rounding of unit-feature logits (~1e-7 * scale per term).
    floor = 1e-6 * max(1.0, scale)
    assert_close(dq, ref[1], 2e-4, floor, "dq")
    assert_close(dk, ref[2], 2e-4, floor, "dk")
    assert_close(ds, ref[3], 2e-4, floor, "dscale")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 120),
    extra=st.integers(0, 150),
    d=st.integers(1, 64),
    tile=st.integers(1, 64),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_infonce_property(b, extra, d, tile, reduction, seed):
    """More keys than queries, arbitrary labels, every reduction."""
    n = b + extra
    q, k = features(b, d, seed=seed), features(n, d, seed=seed + 1)
    labels = torch.randint(0, n, (b,), generator=torch.Generator().manual_seed(seed))
    s = torch.tensor(9.0, requires_grad=True)
    loss = bigbatch.infonce_loss(q, k, s, labels=labels, reduction=reduction, backend=TorchTiles(tile, tile + 3))
    weights = torch.rand(loss.shape, dtype=torch.float64) if reduction == "none" else None
    out = (loss * weights.float()).sum() if weights is not None else loss
    dq, dk, ds = _grads(out, (q, k, s))

    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    s64 = torch.tensor(9.0, dtype=torch.float64, requires_grad=True)
    ref = reference.infonce_loss(q64, k64, s64, labels=labels, reduction=reduction)
    ref_out = (ref * weights).sum() if weights is not None else ref
    rq, rk, rs = _grads(ref_out, (q64, k64, s64))
    assert loss.shape == ref.shape
    _assert_loss(loss, ref, 9.0, b if reduction == "sum" else 1)
    # Floor: each probability carries ~|S| * 2^-23 relative error (README, "Precision limit"), so a
    # gradient that cancels to ~0 (D = 1, many keys) keeps ~scale * |S| * 2^-23 per row; |S| <= 9.
    floor = 4 * 9.0 * 9.0 * 2.0**-23 * (b if reduction != "mean" else 1)
    assert_close(dq, rq, 2e-4, floor, "dq")
    assert_close(dk, rk, 2e-4, floor, "dk")
    assert_close(ds, rs, 2e-4, floor, "dscale")


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_infonce_default_labels_equal_row_direction_of_clip(backend):
    q, k = features(40, 8, seed=3), features(40, 8, seed=4)
    one_way = bigbatch.infonce_loss(q, k, 5.0, backend=backend)
    other_way = bigbatch.infonce_loss(k, q, 5.0, backend=backend)
    clip = bigbatch.clip_loss(q, k, 5.0, backend=backend)
    assert abs((0.5 * (one_way + other_way) - clip).item()) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_accumulate_in_fp32(backend, dtype):
    """Half inputs: fp32 accumulation (error vs the float64 loss of the same rounded inputs ~1e-6),
    gradients returned in the input dtype (rounding of the output only)."""
    q, k = features(150, 33, dtype=dtype, seed=5), features(150, 33, dtype=dtype, seed=6)
    s = torch.tensor(20.0, requires_grad=True)
    loss = bigbatch.clip_loss(q, k, s, backend=backend)
    dq, dk, ds = _grads(loss, (q, k, s))
    assert loss.dtype == torch.float32
    assert dq.dtype == dtype and dk.dtype == dtype and ds.dtype == torch.float32
    ref = _clip_ref64(q, k, 20.0)
    assert_rel(loss, ref[0], 1e-5, "loss")
    assert_rel(dq, ref[1], 1e-2, "dq")
    assert_rel(dk, ref[2], 1e-2, "dk")
    assert_rel(ds, ref[3], 1e-4, "dscale")


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_huge_logits_are_finite_and_exact(backend):
    """Unnormalised features with logits of order 1e4: no overflow, float64 agreement."""
    q = features(64, 16, seed=7, normalize=False) * 10
    k = features(64, 16, seed=8, normalize=False) * 10
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    s = torch.tensor(100.0, requires_grad=True)
    loss = bigbatch.clip_loss(q, k, s, backend=backend)
    dq, dk, ds = _grads(loss, (q, k, s))
    ref = _clip_ref64(q, k, 100.0)
    assert ref[0].item() > 1e3  # the logits really are huge
    # fp32 logits of size 1e4 carry ~1e-3 absolute rounding: that bounds any fp32 method.
    assert_rel(loss, ref[0], 1e-5, "loss")
    assert_rel(dq, ref[1], 1e-3, "dq")
    assert_rel(dk, ref[2], 1e-3, "dk")
    assert_rel(ds, ref[3], 1e-3, "dscale")


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_duplicated_rows(backend):
    """Identical rows (ties in every tile) are handled exactly."""
    base = features(10, 12, seed=9).detach()
    q = base.repeat(5, 1).requires_grad_()
    k = features(50, 12, seed=10)
    k2 = k.detach().clone()
    k2[10:20] = k2[:10]
    k2.requires_grad_()
    loss = bigbatch.clip_loss(q, k2, 7.0, backend=backend)
    dq, dk = _grads(loss, (q, k2))
    ref = _clip_ref64(q, k2, 7.0)
    assert_rel(loss, ref[0], 1e-5, "loss")
    assert_rel(dq, ref[1], 1e-4, "dq")
    assert_rel(dk, ref[2], 1e-4, "dk")


@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_nan_features_give_nan_loss(backend):
    q, k = features(20, 6, seed=11).detach(), features(20, 6, seed=12).detach()
    q[3, 2] = float("nan")
    assert math.isnan(bigbatch.clip_loss(q, k, 3.0, backend=backend).item())
    assert math.isnan(bigbatch.infonce_loss(k, q, 3.0, backend=backend).item())
    per_row = bigbatch.infonce_loss(q, k, 3.0, reduction="none", backend=backend)
    assert math.isnan(per_row[3].item())


def test_gradcheck_float64():
    q, k = features(9, 5, dtype=torch.float64, seed=13), features(9, 5, dtype=torch.float64, seed=14)
    s = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    be = TorchTiles(tile_rows=4, tile_cols=3)
    assert torch.autograd.gradcheck(lambda a, b, c: bigbatch.clip_loss(a, b, c, backend=be), (q, k, s))
    labels = torch.tensor([0, 3, 3, 8, 1, 2, 7, 6, 5])
    k2 = features(11, 5, dtype=torch.float64, seed=15)
    assert torch.autograd.gradcheck(
        lambda a, b, c: bigbatch.infonce_loss(a, b, c, labels=labels, reduction="none", backend=be), (q, k2, s)
    )


def test_gradients_accumulate_into_dot_grad():
    """A plain float scale, features only: grads accumulate into .grad like any torch op."""
    q, k = features(12, 4, seed=16), features(12, 4, seed=17)
    bigbatch.clip_loss(q, k, 3.0, backend="torch").backward()
    g1 = q.grad.clone()
    bigbatch.clip_loss(q, k, 3.0, backend="torch").backward()
    assert rel_err(q.grad, 2 * g1) < 1e-6


def test_module_matches_functional_and_output_dict():
    q, k = features(30, 10, seed=18), features(30, 10, seed=19)
    logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    mod = bigbatch.ClipLoss(backend="torch")
    out = mod(q, k, logit_scale.exp(), output_dict=True)
    assert set(out) == {"contrastive_loss"}
    out["contrastive_loss"].backward()
    ref = _clip_ref64(q, k, logit_scale.exp().item())
    assert_rel(out["contrastive_loss"], ref[0], 1e-5, "loss")
    # d loss / d logit_scale = d loss / d scale * scale
    assert_rel(logit_scale.grad, ref[3] * logit_scale.exp().item(), 1e-4, "d logit_scale")
    assert torch.equal(mod(q, k, logit_scale.exp()), out["contrastive_loss"])


def test_auto_backend_on_cpu_is_torch_tiles():
    from bigbatch.backends import resolve_backend

    assert isinstance(resolve_backend("auto", torch.device("cpu")), TorchTiles)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("loss", ["clip", "infonce", "siglip"])
@pytest.mark.parametrize("how", ["penalty", "hessian"])
def test_double_backward_is_a_clear_error(backend, loss, how):
    """The tiled backwards recompute tiles without a graph: a create_graph=True backward through them
    would miss every second-order term (it returned zeros and wrong penalty gradients, silently)."""
    dev = "cpu"
    if backend == "triton":
        pytest.importorskip("triton")
        dev = TRITON_DEVICE
    q = torch.randn(6, 4, dtype=torch.float32, device=dev, requires_grad=True)
    k = torch.randn(6, 4, dtype=torch.float32, device=dev, requires_grad=True)
    scale = torch.tensor(2.0, device=dev, requires_grad=True)

    def f(q, k, scale):
        if loss == "siglip":
            return bigbatch.siglip_loss(q, k, scale, -1.0, backend=backend)
        fn = bigbatch.clip_loss if loss == "clip" else bigbatch.infonce_loss
        return fn(q, k, scale, backend=backend)

    with pytest.raises(RuntimeError, match="first-order gradients only.*backend='reference'"):
        if how == "penalty":
            (g,) = torch.autograd.grad(f(q, k, scale), q, create_graph=True)
            (g ** 2).sum().backward()
        else:
            torch.autograd.functional.hessian(lambda s: f(q.detach(), k.detach(), s), scale.detach())


@pytest.mark.parametrize("loss", ["clip", "infonce", "siglip"])
def test_batched_gradients_are_a_clear_error(loss):
    """autograd.grad(..., is_grads_batched=True) vmaps the backward: the tiles accumulated in place
    failed with an internal vmap error naming aten::mul_; the reference backend supports it."""
    q = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)

    def f(backend):
        if loss == "siglip":
            return bigbatch.siglip_loss(q, k, 2.0, -1.0, backend=backend)
        return (bigbatch.clip_loss if loss == "clip" else bigbatch.infonce_loss)(q, k, 2.0, backend=backend)

    batch = torch.tensor([1.0, 2.0], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="do not support batched gradients"):
        torch.autograd.grad(f("torch"), q, batch, is_grads_batched=True)
    (g,) = torch.autograd.grad(f("reference"), q, batch, is_grads_batched=True)
    (one,) = torch.autograd.grad(f("reference"), q)
    assert torch.allclose(g[1], 2 * one)


def test_reference_backend_gives_second_derivatives():
    q, k = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    s = torch.tensor(2.0, dtype=torch.float64)
    h = torch.autograd.functional.hessian(lambda s: bigbatch.clip_loss(q, k, s, backend="reference"), s)
    eps = 1e-4
    g = lambda s: torch.autograd.grad(bigbatch.clip_loss(q, k, s.requires_grad_(), backend="reference"), s)[0]  # noqa: E731
    fd = (g(s + eps) - g(s - eps)) / (2 * eps)
    assert torch.allclose(h, fd, rtol=1e-6)


@pytest.mark.parametrize("loss", ["clip", "infonce", "siglip"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_autocast_region_changes_nothing(loss, backend):
    """OpenCLIP computes its loss inside the step's autocast: the losses turn it off and compute in
    their inputs' dtype (before: the torch tiles' forward ran in bf16 and its fp32 backward
    recomputed different tiles, a 0.34 relative error in d image_features at scale 100)."""
    g = torch.Generator().manual_seed(7)
    q0, k0 = torch.randn(37, 19, generator=g), torch.randn(37, 19, generator=g)
    q0, k0 = q0 / q0.norm(dim=1, keepdim=True), k0 / k0.norm(dim=1, keepdim=True)

    def run(amp: bool, backward_inside: bool):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        scale = torch.tensor(100.0, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            if loss == "clip":
                out = bigbatch.clip_loss(q, k, scale, backend=backend)
            elif loss == "infonce":
                out = bigbatch.infonce_loss(q, k, scale, backend=backend)
            else:
                out = bigbatch.siglip_loss(q, k, scale, -5.0, backend=backend)
            if backward_inside:
                out.backward()
        if not backward_inside:
            out.backward()
        return out.detach(), q.grad, k.grad, scale.grad

    ref = run(False, False)
    # "reference" is plain autograd: a backward run inside an autocast region follows autocast, as
    # any autograd graph's does; the tiled backends' own backward turns it off
    for inside in (False, True) if backend != "reference" else (False,):
        got = run(True, inside)
        assert got[0].dtype == torch.float32
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (inside, a, b)


@pytest.mark.parametrize("fn", ["clip", "infonce"])
def test_inference_mode_features_with_a_trained_scale(fn):
    """Features from a frozen tower made under inference_mode, a trained scale: the tiled loss
    saved the features themselves for its backward, which torch refuses for inference tensors."""
    with torch.inference_mode():
        q, k = torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 5, dtype=torch.float64)
    log_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    call = bigbatch.clip_loss if fn == "clip" else bigbatch.infonce_loss
    call(q, k, log_scale.exp(), backend="torch").backward()
    ref_scale = log_scale.detach().clone().requires_grad_()
    (reference.clip_loss if fn == "clip" else reference.infonce_loss)(q.clone(), k.clone(), ref_scale.exp()).backward()
    assert torch.allclose(log_scale.grad, ref_scale.grad, rtol=1e-12, atol=0)
