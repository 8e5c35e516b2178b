"""siglip_loss / SigLipLoss on the CPU backends ("reference", "torch" tiles) against float64 truths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import bigbatch
from bigbatch import reference
from bigbatch.backends import TorchTiles
from bigbatch.backends.torch_sigmoid import TorchSigmoid

from helpers import assert_close, assert_rel, features, rel_err

BACKENDS = ["reference", "torch", TorchSigmoid(tile_rows=7, tile_cols=5)]


def openclip_siglip(image, text, logit_scale, logit_bias):
    """OpenCLIP's SigLipLoss (one rank), written out: labels 2*I - 1, sum, divided by the batch size."""
    logits = logit_scale * image @ text.T + logit_bias
    labels = 2 * torch.eye(image.shape[0], dtype=image.dtype) - 1
    return -F.logsigmoid(labels * logits).sum() / image.shape[0]


def naive_siglip(image, text, scale, bias, labels=None):
    """The definition with explicit loops over pairs (tiny sizes only), float64."""
    image, text = image.detach(), text.detach()
    b = image.shape[0]
    total = 0.0
    for i in range(b):
        for j in range(b):
            positive = (i == j) if labels is None else bool(labels[i] == labels[j])
            u = float(scale) * float(image[i].double() @ text[j].double()) + float(bias)
            z = 1.0 if positive else -1.0
            total += math.log1p(math.exp(-z * u)) if -z * u < 30 else -z * u + math.log1p(math.exp(z * u))
    return total / b


def _scalars(scale=2.5, bias=-3.0, dtype=torch.float64):
    return (
        torch.tensor(math.log(scale), dtype=dtype, requires_grad=True),
        torch.tensor(bias, dtype=dtype, requires_grad=True),
    )


def _loss_and_grads(fn, q, k, log_scale, bias, **kw):
    loss = fn(q, k, log_scale.exp(), bias, **kw)
    grads = torch.autograd.grad(loss, (q, k, log_scale, bias))
    return loss.detach(), grads


def test_reference_matches_openclip_and_the_definition():
    q, k = features(9, 6, dtype=torch.float64, seed=1), features(9, 6, dtype=torch.float64, seed=2)
    scale, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64)
    ref = reference.siglip_loss(q, k, scale, bias)
    assert abs(ref.item() - openclip_siglip(q, k, scale, bias).item()) <= 1e-12 * abs(ref.item())
    assert abs(ref.item() - naive_siglip(q, k, scale, bias)) <= 1e-12 * abs(ref.item())
    labels = torch.tensor([0, 1, 0, 2, 2, 3, 1, 0, 4])
    ref_l = reference.siglip_loss(q, k, scale, bias, labels)
    assert abs(ref_l.item() - naive_siglip(q, k, scale, bias, labels)) <= 1e-12 * abs(ref_l.item())


@pytest.mark.parametrize("backend", BACKENDS, ids=["reference", "torch", "torch-7x5"])
@pytest.mark.parametrize("with_labels", [False, True])
def test_float64_loss_and_all_gradients(backend, with_labels):
    b, d = 23, 11
    q, k = features(b, d, dtype=torch.float64, seed=3), features(b, d, dtype=torch.float64, seed=4)
    labels = torch.randint(0, 6, (b,), generator=torch.Generator().manual_seed(0)) if with_labels else None
    log_scale, bias = _scalars()
    ref, ref_g = _loss_and_grads(openclip_siglip if labels is None else reference.siglip_loss, q, k, log_scale, bias,
                                 **({} if labels is None else {"labels": labels}))
    out, out_g = _loss_and_grads(bigbatch.siglip_loss, q, k, log_scale, bias, labels=labels, backend=backend)
    assert_rel(out, ref, 1e-12, "loss")
    for name, a, r in zip(("d image", "d text", "d log_scale", "d bias"), out_g, ref_g):
        assert_rel(a, r, 1e-11, name)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 33),
    d=st.integers(1, 17),
    tile_rows=st.integers(1, 12),
    tile_cols=st.integers(1, 12),
    n_classes=st.one_of(st.none(), st.integers(1, 5)),
    scale=st.floats(0.1, 50.0),
    bias=st.floats(-15.0, 15.0),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
@example(b=1, d=14, tile_rows=1, tile_cols=1, n_classes=None, scale=26.0, bias=0.0, dtype=torch.float32, seed=0)
def test_property_torch_tiles_match_float64(b, d, tile_rows, tile_cols, n_classes, scale, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(b, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    labels = None if n_classes is None else torch.randint(0, n_classes, (b,), generator=g)
    log_scale, bias_t = _scalars(scale, bias)
    out, out_g = _loss_and_grads(
        bigbatch.siglip_loss, q, k, log_scale, bias_t, labels=labels, backend=TorchSigmoid(tile_rows, tile_cols)
    )
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    ref, ref_g = _loss_and_grads(reference.siglip_loss, q64, k64, log_scale, bias_t, labels=labels)
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    # fp32 logits carry an absolute error of ~eps32 * scale * sum_d |q_d k_d| each; where the loss is
    # tiny (large positive logits: softplus(-x) ~ exp(-x)) that error is all of its relative error,
    # so the bound gets that floor: the loss is a 1/B-weighted sum of terms with slope <= 1 in x.
    eps = 2.0**-52 if dtype == torch.float64 else 2.0**-24
    floor = 8 * eps * scale * (q.detach().double().abs() @ k.detach().double().abs().T).sum().item() / b
    assert_close(out, ref, tol, floor, "loss")
    for name, a, r in zip(("d image", "d text", "d log_scale", "d bias"), out_g, ref_g):
        assert a.dtype == (dtype if name.startswith("d i") or name.startswith("d t") else torch.float64)
        # Gradients of features are returned in the features' dtype; compare with an absolute floor.
        err = (a.double() - r).norm().item()
        assert err <= tol * 10 * max(r.norm().item(), 1e-3), f"{name}: error {err:.3e} vs norm {r.norm().item():.3e}"


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_half_inputs_fp32_accumulation(dtype, tol):
    b, d = 40, 24
    q, k = features(b, d, dtype=dtype, seed=5), features(b, d, dtype=dtype, seed=6)
    log_scale, bias = _scalars(20.0, -8.0)
    out, out_g = _loss_and_grads(bigbatch.siglip_loss, q, k, log_scale, bias, backend=TorchSigmoid(16, 16))
    assert out.dtype == torch.float32 and out_g[0].dtype == dtype and out_g[1].dtype == dtype
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref, ref_g = _loss_and_grads(reference.siglip_loss, q64, k64, log_scale, bias)
    assert_rel(out, ref, tol, "loss")
    for name, a, r in zip(("d image", "d text", "d log_scale", "d bias"), out_g, ref_g):
        assert_rel(a, r, tol, name)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_huge_logits_are_stable(backend):
    # |logits| ~ 1e4: softplus must not overflow, the gradient must not cancel to 0/NaN.
    q = features(6, 4, dtype=torch.float64, seed=7)
    k = q.detach().clone().requires_grad_()
    log_scale, bias = _scalars(1e4, 0.0)
    out, out_g = _loss_and_grads(bigbatch.siglip_loss, q, k, log_scale, bias, backend=backend)
    ref = naive_siglip(q.detach(), k.detach(), 1e4, 0.0)
    assert math.isfinite(out.item()) and abs(out.item() - ref) <= 1e-9 * abs(ref)
    assert all(torch.isfinite(g).all() for g in out_g)
    q32, k32 = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    out32 = bigbatch.siglip_loss(q32, k32, 1e4, 0.0, backend=backend)
    assert abs(out32.item() - ref) <= 1e-4 * abs(ref)


def test_tiny_losses_keep_relative_precision():
    # Every pair is classified with a huge margin: each term is ~e^-30, the sum must not round to 0.
    q = torch.eye(8, dtype=torch.float32)
    out = bigbatch.siglip_loss(q, q.clone(), 60.0, -30.0, backend="torch")
    ref = naive_siglip(q, q, 60.0, -30.0)
    assert ref > 0 and abs(out.item() - ref) <= 1e-5 * ref


def test_no_grad_and_grad_paths_agree_and_incoming_gradient_scales():
    q, k = features(17, 9, seed=8), features(17, 9, seed=9)
    log_scale, bias = _scalars(5.0, -2.0, dtype=torch.float32)
    with torch.no_grad():
        plain = bigbatch.siglip_loss(q, k, log_scale.exp(), bias, backend="torch")
    loss = bigbatch.siglip_loss(q, k, log_scale.exp(), bias, backend="torch")
    assert abs(plain.item() - loss.item()) <= 1e-6 * abs(loss.item())
    g1 = torch.autograd.grad(loss, (q, k, log_scale, bias), retain_graph=True)
    g3 = torch.autograd.grad(3.0 * loss, (q, k, log_scale, bias))
    for a, b in zip(g1, g3):
        assert rel_err(b, 3.0 * a) <= 1e-6


def test_python_scalars_and_module_signature():
    q, k = features(12, 5, dtype=torch.float64, seed=10), features(12, 5, dtype=torch.float64, seed=11)
    ref = openclip_siglip(q, k, 7.0, -4.0)
    loss_fn = bigbatch.SigLipLoss(backend="torch")
    out = loss_fn(q, k, 7.0, -4.0)
    assert abs(out.item() - ref.item()) <= 1e-12 * abs(ref.item())
    as_dict = loss_fn(q, k, 7.0, -4.0, output_dict=True)
    assert set(as_dict) == {"contrastive_loss"} and torch.equal(as_dict["contrastive_loss"], out)
    no_bias = loss_fn(q, k, torch.tensor(7.0, dtype=torch.float64))  # logit_bias=None means 0
    assert abs(no_bias.item() - openclip_siglip(q, k, 7.0, 0.0).item()) <= 1e-12 * no_bias.item()
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    with_labels = loss_fn(q, k, 7.0, -4.0, labels=labels)
    assert abs(with_labels.item() - reference.siglip_loss(q, k, 7.0, -4.0, labels).item()) <= 1e-12 * abs(
        with_labels.item()
    )


def test_nan_features_give_nan_loss():
    q, k = features(6, 4, seed=12), features(6, 4, seed=13)
    q = q.detach().clone()
    q[2, 1] = float("nan")
    for backend in ("torch", "reference"):
        assert math.isnan(bigbatch.siglip_loss(q, k, 3.0, -1.0, backend=backend).item())


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(image_features=torch.randn(4)), ValueError, "image_features must be 2-D"),
        (dict(text_features=torch.randn(5, 3)), ValueError, "same batch size"),
        (dict(text_features=torch.randn(4, 2)), ValueError, "feature dimension"),
        (dict(text_features=torch.randn(4, 3, dtype=torch.float64)), TypeError, "same dtype"),
        (dict(image_features=torch.randn(0, 3), text_features=torch.randn(0, 3)), ValueError, "at least one row"),
        (dict(image_features=torch.randint(0, 3, (4, 3))), TypeError, "floating dtype"),
        (dict(scale="2"), TypeError, "scale"),
        (dict(bias=torch.ones(2)), ValueError, "bias must be a scalar"),
        (dict(bias=float("nan")), ValueError, "bias must be finite"),
        (dict(labels=torch.ones(4)), TypeError, "labels must have an integer dtype"),
        (dict(labels=torch.ones(3, dtype=torch.long)), ValueError, r"labels must have shape \(4,\)"),
        (dict(labels=[0, 1, 2, 3]), TypeError, "labels must be None or a torch.Tensor"),
        (dict(backend="cuda-magic"), ValueError, "backend must be one of"),
        (dict(backend=TorchTiles()), TypeError, "sigmoid backend object"),
        (dict(group="world"), ValueError, "group was given"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, exc, match):
    args = dict(image_features=torch.randn(4, 3), text_features=torch.randn(4, 3), scale=2.0, bias=0.0)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        bigbatch.siglip_loss(
            args.pop("image_features"), args.pop("text_features"), args.pop("scale"), args.pop("bias"), **args
        )


def test_backend_object_settings_are_validated():
    with pytest.raises(ValueError, match="tile_rows"):
        TorchSigmoid(tile_rows=0)
