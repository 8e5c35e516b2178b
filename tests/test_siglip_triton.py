"""The Triton sigmoid-loss kernel: under the interpreter on CPU (fp32/fp16: the interpreter's
bf16 dot is not trustworthy) and, marked ``gpu``, on a real GPU with bf16/fp16/fp32."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import bigbatch
from bigbatch import reference

from helpers import TRITON_DEVICE, assert_close, assert_rel

triton = pytest.importorskip("triton")

from bigbatch.backends.gemm import mm_acc  # noqa: E402
from bigbatch.backends.triton_sigmoid import TritonSigmoid  # noqa: E402

DEVICE = TRITON_DEVICE


def _case(b, d, dtype, seed, *, n_classes=None, scale=10.0, bias=-5.0, device=DEVICE, normalize=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, d, generator=g, dtype=torch.float64)
    if normalize:
        q, k = q / q.norm(dim=1, keepdim=True), k / k.norm(dim=1, keepdim=True)
    labels = None if n_classes is None else torch.randint(0, n_classes, (b,), generator=g).to(device)
    q = q.to(device=device, dtype=dtype).requires_grad_()
    k = k.to(device=device, dtype=dtype).requires_grad_()
    log_scale = torch.tensor(math.log(scale), dtype=torch.float32, device=device, requires_grad=True)
    bias_t = torch.tensor(bias, dtype=torch.float32, device=device, requires_grad=True)
    return q, k, labels, log_scale, bias_t


def _compare(backend, q, k, labels, log_scale, bias, tol):
    loss = bigbatch.siglip_loss(q, k, log_scale.exp(), bias, labels=labels, backend=backend)
    grads = torch.autograd.grad(loss, (q, k, log_scale, bias))
    # float64 truth on the SAME (rounded) inputs: only the kernel's arithmetic is measured.
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ls64, b64 = log_scale.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    ref = reference.siglip_loss(q64, k64, ls64.exp(), b64, labels)
    ref_g = torch.autograd.grad(ref, (q64, k64, ls64, b64))
    assert_rel(loss, ref, tol, "loss")
    for name, a, r in zip(("d image", "d text"), grads[:2], ref_g[:2]):
        assert_rel(a, r, tol, name)
    # d log_scale and d bias are sums over all B^2 pairs of terms of both signs: fp32 accumulation
    # errs relative to the sum of their magnitudes, not to the (possibly cancelling) result.
    with torch.no_grad():
        dx = _pair_slopes(q64, k64, ls64.exp(), b64, labels)  # |dL/dlogit_ij|
        mags = ((dx * ls64.exp() * (q64 @ k64.T).abs()).sum(), dx.sum())
    for name, a, r, m in zip(("d log_scale", "d bias"), grads[2:], ref_g[2:], mags):
        assert_close(a, r, tol, 16 * 2.0**-24 * m.item(), name)
    assert grads[0].dtype == q.dtype and grads[1].dtype == k.dtype
    return loss


def _pair_slopes(q, k, scale, bias, labels):
    """|d loss / d logit_ij| of the float64 reference: sigmoid(-z_ij x_ij) / B."""
    x = scale * (q @ k.T) + bias
    pos = torch.eye(q.shape[0], k.shape[0], dtype=torch.bool) if labels is None else labels[:, None].cpu() == labels[None, :].cpu()
    z = pos.to(x.device).to(x.dtype) * 2 - 1
    return torch.sigmoid(-z * x) / q.shape[0]


# ----------------------------------------------------------------------------- interpreter / any device


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("n_classes", [None, 4])
def test_kernel_matches_float64_with_tails_and_workspace_tiles(dtype, tol, n_classes):
    # b=45, d=19: tails in rows, columns and the D loop; 40x33 workspace tiles: diagonal offsets.
    case = _case(45, 19, dtype, seed=1, n_classes=n_classes)
    _compare(TritonSigmoid(tile_rows=40, tile_cols=33), *case, tol)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 70),
    d=st.integers(1, 40),
    n_classes=st.one_of(st.none(), st.integers(1, 6)),
    scale=st.floats(0.5, 40.0),
    bias=st.floats(-12.0, 12.0),
    seed=st.integers(0, 2**16),
)
@example(b=55, d=25, n_classes=None, scale=10.001953125, bias=-9.1875, seed=818)
def test_property_kernel_fp32(b, d, n_classes, scale, bias, seed):
    case = _case(b, d, torch.float32, seed, n_classes=n_classes, scale=scale, bias=bias)
    _compare(TritonSigmoid(tile_rows=37, tile_cols=50), *case, 2e-5)


def test_kernel_huge_logits_and_tiny_losses():
    # |logits| ~ 1e4 (no overflow), then every pair right with a big margin (terms ~e^-30).
    q, k, _, _, _ = _case(12, 8, torch.float32, seed=2)
    k = q.detach().clone().requires_grad_()
    out = bigbatch.siglip_loss(q, k, 1e4, 0.0, backend="triton")
    ref = reference.siglip_loss(q.detach().double(), k.detach().double(), 1e4, 0.0)
    assert math.isfinite(out.item()) and abs(out.item() - ref.item()) <= 1e-4 * ref.item()
    g = torch.autograd.grad(out, (q, k))
    assert all(torch.isfinite(x).all() for x in g)
    eye = torch.eye(8, dtype=torch.float32, device=DEVICE)
    tiny = bigbatch.siglip_loss(eye, eye.clone(), 60.0, -30.0, backend="triton")
    ref_tiny = reference.siglip_loss(eye.double(), eye.double(), 60.0, -30.0)
    assert ref_tiny.item() > 0 and abs(tiny.item() - ref_tiny.item()) <= 1e-5 * ref_tiny.item()


def test_kernel_loss_only_pass_nan_and_errors():
    q, k, _, ls, b = _case(30, 16, torch.float32, seed=3)
    with torch.no_grad():
        plain = bigbatch.siglip_loss(q, k, ls.exp(), b, backend="triton")
    ref = reference.siglip_loss(q.detach().double(), k.detach().double(), ls.detach().double().exp(), b.detach().double())
    assert_rel(plain, ref, 1e-5, "loss-only pass")
    bad = q.detach().clone()
    bad[3, 4] = float("nan")
    assert math.isnan(bigbatch.siglip_loss(bad, k, 3.0, 0.0, backend="triton").item())
    with pytest.raises(ValueError, match="float64"):
        bigbatch.siglip_loss(q.detach().double(), k.detach().double(), 3.0, 0.0, backend="triton")
    with pytest.raises(ValueError, match="fp32_precision"):
        TritonSigmoid(fp32_precision="fast")


def test_mm_acc_accumulates_in_fp32():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(33, 70, generator=g).to(device=DEVICE, dtype=torch.float16)
    b = torch.randn(70, 21, generator=g).to(device=DEVICE, dtype=torch.float16)
    acc = torch.randn(33, 21, generator=g).to(DEVICE)
    want = acc.double() + a.double() @ b.double()
    mm_acc(acc, a, b)
    assert_rel(acc, want, 1e-6, "acc += a @ b")


def test_mm_acc_mode_is_decided_per_device_type(monkeypatch):
    """The GEMM form of ``acc += a @ b`` was cached once per process from the first device: a CPU
    call first made CUDA up-cast (fp32 copies of the half G tile on the GPU), a CUDA call first
    made a later CPU call use ``addmm(out_dtype=)``, which the CPU lacks (NotImplementedError)."""
    from bigbatch.backends import gemm

    monkeypatch.setattr(gemm, "_MM_ACC_MODES", {"cuda": "addmm_out_dtype"})  # as after a first CUDA call
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(*s, generator=g).to(torch.float16) for s in ((9, 12), (12, 5)))
    acc = torch.randn(9, 5, generator=g)
    want = acc.double() + a.double() @ b.double()
    mm_acc(acc, a, b)
    assert_rel(acc, want, 1e-6, "acc += a @ b on the CPU after a CUDA decision")
    assert gemm._MM_ACC_MODES == {"cuda": "addmm_out_dtype", "cpu": "upcast"}
    monkeypatch.setattr(gemm, "_MM_ACC_MODES", {})
    gemm._mm_acc_mode(torch.device("cpu"))
    assert "cuda" not in gemm._MM_ACC_MODES  # a CPU call decides nothing for CUDA


# ----------------------------------------------------------------------------- real GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("n_classes", [None, 50])
def test_gpu_kernel_matches_float64(dtype, tol, n_classes):
    case = _case(3001, 200, dtype, seed=5, n_classes=n_classes, scale=30.0, bias=-10.0, device="cuda")
    _compare(TritonSigmoid(tile_rows=1024, tile_cols=2000), *case, tol)  # several workspace tiles, tails
    _compare("auto", *case, tol)


@pytest.mark.gpu
def test_gpu_tf32_option_and_large_d():
    case = _case(1500, 768, torch.float32, seed=6, device="cuda")
    _compare(TritonSigmoid(fp32_precision="tf32"), *case, 5e-3)


def _trained_case(b, d, dtype, scale, bias, device, seed=3):
    """Positives aligned (u >> 0), negatives near orthogonal (u << 0): a trained SigLIP model,
    where the per-pair gradients G = sigmoid(u) of the negatives are tiny."""
    g = torch.Generator().manual_seed(seed)
    eye = torch.eye(b, d, dtype=torch.float64)
    q = torch.nn.functional.normalize(eye + 0.05 * torch.randn(b, d, generator=g, dtype=torch.float64), dim=1)
    k = torch.nn.functional.normalize(eye + 0.05 * torch.randn(b, d, generator=g, dtype=torch.float64), dim=1)
    q = q.to(device=device, dtype=dtype).requires_grad_()
    k = k.to(device=device, dtype=dtype).requires_grad_()
    log_scale = torch.tensor(math.log(scale), dtype=torch.float32, device=device, requires_grad=True)
    bias_t = torch.tensor(bias, dtype=torch.float32, device=device, requires_grad=True)
    return q, k, None, log_scale, bias_t


def _scaled_grads_error(backend, case, loss_scale=65536.0):
    """Relative errors of d image and d text of ``loss * loss_scale`` (as a GradScaler scales an
    fp16 loss, so that fp16 gradients do not underflow) against float64 on the same inputs."""
    q, k, labels, log_scale, bias = case
    loss = bigbatch.siglip_loss(q, k, log_scale.exp(), bias, labels=labels, backend=backend)
    got = torch.autograd.grad(loss * loss_scale, (q, k))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref = reference.siglip_loss(q64, k64, log_scale.detach().double().exp(), bias.detach().double(), labels)
    want = torch.autograd.grad(ref * loss_scale, (q64, k64))
    return [((a.double() - r).norm() / r.norm()).item() for a, r in zip(got, want)]


@pytest.mark.parametrize("scale,bias", [(10.0, -10.0), (50.0, -25.0)])
def test_fp16_gradients_of_a_trained_model(scale, bias):
    """fp16 inputs keep the per-pair gradients G in an fp16 workspace: stored as is, |G| < 6e-8
    vanished before any loss scaling could help (dq off by 0.18 at scale 50, bias -25); stored
    times 2^15 and scaled back exactly in the products, they keep fp16 precision down to
    |G| ~ 2e-9 and the gradients stay at the inputs' rounding, as the torch backend's (fp32 G)."""
    errs = _scaled_grads_error(TritonSigmoid(tile_rows=32, tile_cols=48), _trained_case(64, 64, torch.float16, scale, bias, DEVICE))
    assert max(errs) < 2e-3, errs


@pytest.mark.gpu
@pytest.mark.parametrize("scale,bias", [(10.0, -10.0), (50.0, -25.0)])
def test_gpu_fp16_gradients_of_a_trained_model(scale, bias):
    errs = _scaled_grads_error("triton", _trained_case(1024, 1024, torch.float16, scale, bias, "cuda"))
    assert max(errs) < 2e-3, errs


@pytest.mark.gpu
def test_gpu_fp32_products_ignore_the_global_tf32_setting():
    """An explicit fp32_precision='ieee' holds even when the caller allows TF32 globally: the
    gradient products on cuBLAS are run at full fp32 precision (the default, None, follows the
    setting: tests/test_fp32_precision.py)."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        case = _case(1500, 768, torch.float32, seed=6, device="cuda")
        _compare(TritonSigmoid(fp32_precision="ieee"), *case, 1e-5)
        assert torch.get_float32_matmul_precision() == "high"  # the caller's setting is left as it was
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.gpu
def test_gpu_tile_past_two_to_the_31_elements():
    """A tall tile (many queries against a small key chunk, as the ring's uneven shards give) has
    row offsets past 2^31 elements: 64-bit offsets (it read out of bounds before)."""
    m, n, d = 1_100_000, 8, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(m, d, device="cuda", dtype=torch.float16, generator=g) * 0.03
    k = torch.randn(n, d, device="cuda", dtype=torch.float16, generator=g) * 0.03
    s, b = torch.tensor(4.0, device="cuda"), torch.tensor(-2.0, device="cuda")
    dq = torch.zeros(m, d, device="cuda")
    dk = torch.zeros(n, d, device="cuda")
    loss, _ = TritonSigmoid(tile_rows=m, tile_cols=n).sigmoid_pass(q, k, s, b, diagonal=None, dq_acc=dq, dk_acc=dk)
    from bigbatch.backends.torch_sigmoid import TorchSigmoid

    dq_ref = torch.zeros_like(dq)
    dk_ref = torch.zeros_like(dk)
    ref, _ = TorchSigmoid().sigmoid_pass(q, k, s, b, diagonal=None, dq_acc=dq_ref, dk_acc=dk_ref)
    assert_rel(loss, ref, 1e-4, "loss")
    assert_rel(dq, dq_ref, 1e-2, "dq")
    assert_rel(dk, dk_ref, 1e-2, "dk")


@pytest.mark.parametrize("api", ["legacy", "backend"])
def test_fp32_matmul_restores_the_callers_setting(api):
    """The products' precision guard sets the CUDA matmul's own setting and puts back exactly what
    the caller had, whichever of torch's two APIs the caller used (mixing them made torch raise)."""
    from bigbatch.backends.gemm import fp32_matmul

    mm = torch.backends.cuda.matmul
    if api == "backend" and not hasattr(mm, "fp32_precision"):
        pytest.skip("this torch has only the legacy API")
    old_legacy, old_backend = torch.get_float32_matmul_precision(), getattr(mm, "fp32_precision", None)
    try:
        if api == "legacy":
            torch.set_float32_matmul_precision("high")
        else:
            mm.fp32_precision = "tf32"
        def state():
            return mm.fp32_precision if hasattr(mm, "fp32_precision") else ("tf32" if mm.allow_tf32 else "ieee")

        before = state()
        with fp32_matmul("ieee"):
            assert state() == "ieee"
        assert state() == before
    finally:
        if old_backend is not None:
            mm.fp32_precision = old_backend
        torch.set_float32_matmul_precision(old_legacy)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_ad_and_vmap_are_refused_not_silently_wrong(backend):
    """Dual tensors (forward-mode AD) and torch.func-wrapped tensors have requires_grad=False: the
    loss-only path skipped the autograd Function, so the Triton kernel read the primal alone and
    dropped the tangent with no error (vmap failed deep inside). They now reach the Function,
    which refuses them with torch's own errors, as clip_loss and infonce_loss do."""
    import torch.autograd.forward_ad as fwAD

    dev = DEVICE if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(0)
    q, k, t = (torch.randn(5, 3, generator=g).to(dev) for _ in range(3))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match="jvp"):
            bigbatch.siglip_loss(fwAD.make_dual(q, t), k, 2.0, -1.0, backend=backend)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.vmap(lambda a: bigbatch.siglip_loss(a, k, 2.0, -1.0, backend=backend))(torch.randn(2, 5, 3, device=dev))
    # the reference backend is plain autograd: its tangent is the derivative along t
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(bigbatch.siglip_loss(fwAD.make_dual(q.double(), t.double()), k.double(), 2.0, -1.0,
                                                        backend="reference")).tangent
    qq = q.double().requires_grad_()
    (grad,) = torch.autograd.grad(bigbatch.siglip_loss(qq, k.double(), 2.0, -1.0, backend="reference"), qq)
    assert_close(tangent, (grad * t.double()).sum(), 1e-12, 0.0, "reference tangent")
