"""The one-pass LayerNorm backward (``bigbatch.gradcache.norm_kernel``), its autograd Function
(``norms.LayerNormFunction``), the module swap (``norms.fast_layer_norms``) and its use by the
gradient-caching engine.

On the CPU the kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1) and the
swap, which the library makes for CUDA weights only, is widened to the CPU (``cpu_kernel``)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from bigbatch.gradcache import GradCache, cached_encode, norm_kernel, norms

from helpers import TRITON_DEVICE, assert_close, assert_rel

F64 = torch.float64
# relative tolerance of each gradient against float64, per input dtype (fp32 sums; half inputs
# are rounded when loaded, their dx when stored)
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The swap on CPU tensors too, and a count of the kernel's backward calls."""
    calls = []
    real = norm_kernel.layer_norm_backward

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(norms, "on_kernel_device", lambda t: t.device.type == TRITON_DEVICE)
    monkeypatch.setattr(norms, "ENABLED", True)  # (the default, set against a test that turned it off)
    monkeypatch.setattr(norms, "kernel_available", lambda device: True)  # (its self-test: tested on its own)
    monkeypatch.setattr(norm_kernel, "layer_norm_backward", counted)
    return calls


def reference_grads(x, shape, w, b, eps, dy):
    """Float64 gradients of F.layer_norm for the leaves among x, w, b that require grad."""
    leaves = [t.detach().to(F64).requires_grad_(t.requires_grad) if t is not None else None for t in (x, w, b)]
    out = F.layer_norm(leaves[0], shape, leaves[1], leaves[2], eps)
    out.backward(dy.to(F64))
    return [None if t is None or not t.requires_grad else t.grad for t in leaves]


@settings(max_examples=25, deadline=None)
# found on the H200: one feature per row, whose dx is exactly 0 in exact arithmetic; the GPU's
# fused multiply-adds leave one rounding of w * dy, times 1/std = 1/sqrt(eps) = 316 (the floor)
@example(lead=[2], width=1, split=False, dtype=torch.float32, param_dtype="same", with_bias=False, grads="all",
         transposed=False, seed=0)
@given(
    lead=st.lists(st.integers(0, 9), min_size=0, max_size=3),
    width=st.integers(1, 300),
    split=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    param_dtype=st.sampled_from(["same", "float32"]),
    with_bias=st.booleans(),
    grads=st.sampled_from(["all", "x", "params", "bias"]),
    transposed=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_function_matches_float64(lead, width, split, dtype, param_dtype, with_bias, grads, transposed, seed):
    """Loss-free check of every gradient against float64: random leading shapes (0 rows included),
    odd widths, a normalized shape over one or two trailing dims, half inputs with fp32 or half
    parameters, no bias, each subset of inputs requiring grad, a non-contiguous x and dy."""
    g = torch.Generator().manual_seed(seed)
    shape = (width,) if not split or width % 3 else (3, width // 3)
    pd = dtype if param_dtype == "same" else torch.float32
    full = (*lead, *shape)
    x = (torch.randn(full, generator=g, dtype=F64) * 2 + 0.5)
    if transposed and len(lead) >= 2:  # a non-contiguous view with the same values
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    x = x.to(TRITON_DEVICE, dtype)
    w = (torch.randn(shape, generator=g, dtype=F64) + 1).to(TRITON_DEVICE, pd)
    if transposed and len(shape) == 1:  # a strided weight (a Parameter made from a view)
        w = torch.stack([w, torch.zeros_like(w)], dim=1)[:, 0]
    b = torch.randn(shape, generator=g, dtype=F64).to(TRITON_DEVICE, pd) if with_bias else None
    x.requires_grad_(grads in ("all", "x"))
    w.requires_grad_(grads in ("all", "params"))
    if b is not None:
        b.requires_grad_(grads in ("all", "params", "bias"))
    if not any(t is not None and t.requires_grad for t in (x, w, b)):
        x.requires_grad_(True)
    try:
        plain = F.layer_norm(x.detach(), shape, w.detach(), None if b is None else b.detach(), 1e-5)
    except RuntimeError:  # a dtype mix PyTorch refuses on this device: refused the same way
        with pytest.raises(RuntimeError):
            norms.LayerNormFunction.apply(x, shape, w, b, 1e-5)
        return
    out = norms.LayerNormFunction.apply(x, shape, w, b, 1e-5)
    assert torch.equal(out, plain)
    dy = torch.randn(full, generator=g, dtype=F64).to(TRITON_DEVICE, out.dtype)
    if transposed and len(lead) >= 2:
        dy = dy.transpose(0, 1).contiguous().transpose(0, 1)
    out.backward(dy)
    refs = reference_grads(x, shape, w, b, 1e-5, dy)
    rows = x.detach().double().reshape(-1, w.numel())
    rstd_max = max(1.0, (rows.var(dim=1, unbiased=False) + 1e-5).rsqrt().max().item()) if rows.shape[0] else 1.0
    w_max = w.detach().double().abs().max().item()
    for name, t, ref in zip("xwb", (x, w, b), refs):
        if ref is None:
            assert t is None or t.grad is None, f"d{name} should not be computed"
            continue
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape, name
        # dx cancels (its rows sum to zero): an absolute floor relative to its terms, w * dy / std
        floor = 1e-6 * (dy.double().norm().item() * w_max * rstd_max * 3 + 1) if name == "x" else 1e-6
        assert_close(t.grad, ref, TOL[dtype] if name == "x" else max(TOL[dtype] / 4, TOL[pd]), floor, f"d{name}")


def test_kernel_zero_rows_and_wide_rows():
    x = torch.zeros(0, 12, device=TRITON_DEVICE)
    dx, dw, db = norm_kernel.layer_norm_backward(x, x, torch.ones(12, device=TRITON_DEVICE), 1e-5, True, True, True)
    assert dx.shape == (0, 12) and torch.equal(dw, torch.zeros(12, device=TRITON_DEVICE)) and torch.equal(db, dw)
    # a row wider than a tile is many rows of one program: 1 x 2000 (one tile row), 33 x 2000
    for m in (1, 33):
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, 2000, generator=g).to(TRITON_DEVICE).requires_grad_()
        w = torch.randn(2000, generator=g).to(TRITON_DEVICE).requires_grad_()
        dy = torch.randn(m, 2000, generator=g).to(TRITON_DEVICE)
        norms.LayerNormFunction.apply(x, (2000,), w, None, 1e-6).backward(dy)
        rx, rw, _ = reference_grads(x, (2000,), w, None, 1e-6, dy)
        assert_close(x.grad, rx, 2e-5, 1e-5, "dx")
        assert_rel(w.grad, rw, 2e-5, "dw")


def test_specialisation_key_separates_what_triton_specialises_on():
    """Calls that may share one compiled kernel have equal keys; a call differing in anything
    Triton specialises on (a tensor's dtype, device or 16-byte alignment; an int's being 1, its
    divisibility by 16 or its width) gets its own (so the direct launch never runs a kernel
    compiled for another specialisation)."""
    key = norm_kernel.specialisation
    buf = torch.zeros(64)
    base = (buf, 32, 5, 0.5)
    assert key(base) == key((torch.zeros(64), 48, 7, 0.25))
    assert key((buf, 2**31 + 16, 5, 0.5)) != key((buf, 2**63 + 16, 5, 0.5))
    for other in ((buf[1:], 32, 5, 0.5), (buf.double(), 32, 5, 0.5), (buf, 33, 5, 0.5), (buf, 32, 1, 0.5),
                  (buf, 32, 2**31, 0.5), (buf, 32, 2**63 + 3, 0.5), (buf, 32, 5, 1), (buf, 32, True, 0.5)):
        assert key(other) != key(base), other


def test_specialisation_key_is_at_least_as_fine_as_tritons():
    """Against Triton's own specialisation (its C++ ``native_specialize_impl`` with the backend
    class the NVIDIA backend inherits): any two arguments Triton tells apart, the key tells apart."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.compiler import BaseBackend

    native = getattr(libtriton, "native_specialize_impl", None)
    if native is None:
        pytest.skip("this Triton specialises in Python (before 3.4); the key test above covers its rules")
    buf = torch.zeros(80)
    pool = [buf, buf[1:], buf[4:], buf.half(), buf.half()[1:], buf.half()[8:], buf.double(),
            0, 1, 2, 15, 16, 17, 32, -16, -17, 2**31 - 16, 2**31, 2**31 + 16, 2**63 - 16, 2**63 + 16, 0.5, 1.0, True, False]
    for a in pool:
        for b in pool:
            if native(BaseBackend, a, False, True, True) != native(BaseBackend, b, False, True, True):
                assert norm_kernel.specialisation((a,)) != norm_kernel.specialisation((b,)), (a, b)


@pytest.mark.parametrize("direct", [True, False])
def test_kernel_across_specialisations(direct, monkeypatch):
    """One sequence of calls that differ in alignment (views one element in), row count (1, a
    multiple of 16, neither), width and dtype, so that each compiled kernel is offered calls of
    other specialisations: every result within rounding of float64's, launched directly or
    through Triton's JIT each time."""
    monkeypatch.setattr(norm_kernel, "DIRECT", direct)
    g = torch.Generator().manual_seed(5)
    for m, n, dtype, offset in ((32, 48, torch.float32, 0), (32, 48, torch.float32, 1), (17, 48, torch.float32, 0),
                                (1, 48, torch.float32, 1), (32, 45, torch.float32, 0), (33, 45, torch.float32, 3),
                                (32, 48, torch.float16, 0), (32, 48, torch.float16, 1)):
        flat = torch.randn(m * n + offset, generator=g, dtype=F64)
        x = flat[offset:].view(m, n).to(TRITON_DEVICE, dtype)
        if offset:  # a view whose address is not 16-byte aligned
            x = torch.empty(m * n + offset, device=TRITON_DEVICE, dtype=dtype)[offset:].view(m, n).copy_(x)
        w = (torch.randn(n, generator=g, dtype=F64) + 1).to(TRITON_DEVICE)
        dy = torch.randn(m, n, generator=g, dtype=F64).to(TRITON_DEVICE, dtype)
        dx, dw, db = norm_kernel.layer_norm_backward(x, dy, w, 1e-5, True, True, True)
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        br = torch.zeros(n, dtype=F64, device=TRITON_DEVICE, requires_grad=True)
        torch.nn.functional.layer_norm(xr, (n,), wr, br, 1e-5).backward(dy.double())
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert_close(dx, xr.grad, tol, 1e-5 * (dy.double().norm().item() + 1), f"dx {m}x{n} {dtype} +{offset}")
        assert_rel(dw, wr.grad, 1e-5, f"dw {m}x{n} {dtype} +{offset}")
        assert_rel(db, br.grad, 1e-5, f"db {m}x{n} {dtype} +{offset}")


def test_double_backward_is_pytorchs():
    """A create_graph backward through the Function (a forward that differentiates through the
    norm: forces from an energy) gives PyTorch's second derivatives, not constants."""
    g = torch.Generator().manual_seed(2)
    x0, w0, b0, c = (torch.randn(s, generator=g, dtype=F64) for s in ((5, 7), (7,), (7,), (5, 7)))
    got, want = [], []
    for fn, dtype, out in ((norms.LayerNormFunction.apply, torch.float32, got), (F.layer_norm, F64, want)):
        x, w, b = (t.to(TRITON_DEVICE, dtype).requires_grad_() for t in (x0, w0, b0))
        energy = (fn(x, (7,), w, b, 1e-5) * c.to(TRITON_DEVICE, dtype)).pow(2).sum()
        (force,) = torch.autograd.grad(energy, x, create_graph=True)
        force.pow(2).sum().backward()
        out += [force, x.grad, w.grad, b.grad]
    for name, a, r in zip(("force", "dx", "dw", "db"), got, want):
        assert_rel(a, r, 1e-4, name)


def test_functorch_and_forward_ad_take_pytorchs_path(cpu_kernel):
    """vmap / jvp through a swapped norm: the Function has no rule for them, PyTorch's layer norm
    has; the swapped forward takes PyTorch's there (the kernel is not called)."""
    from torch.autograd import forward_ad

    ln = nn.LayerNorm(6).to(TRITON_DEVICE)
    x = torch.randn(4, 3, 6, device=TRITON_DEVICE)
    t = torch.randn(4, 3, 6, device=TRITON_DEVICE)
    with norms.fast_layer_norms([ln]):
        assert type(ln) is norms.OnePassLayerNorm
        batched = torch.vmap(ln)(x)
        with forward_ad.dual_level():
            tangent = forward_ad.unpack_dual(ln(forward_ad.make_dual(x, t))).tangent
    assert torch.allclose(batched, F.layer_norm(x, (6,), ln.weight, ln.bias))
    _, want = torch.func.jvp(lambda v: F.layer_norm(v, (6,), ln.weight.detach(), ln.bias.detach()), (x,), (t,))
    assert torch.allclose(tangent, want, atol=1e-5)
    assert not cpu_kernel


def test_bare_apply_is_the_functions_apply(cpu_kernel):
    """The swapped forward calls the C-level apply (no Python prologue): the same node, output and
    gradients as ``LayerNormFunction.apply``, and the kernel runs in its backward."""
    assert norms._APPLY.__self__ is norms.LayerNormFunction
    assert type(norms._APPLY).__name__ == "builtin_function_or_method"  # C, not Function.apply
    torch.manual_seed(3)
    x = torch.randn(5, 7, device=TRITON_DEVICE, requires_grad=True)
    w = torch.randn(7, device=TRITON_DEVICE, requires_grad=True)
    b = torch.randn(7, device=TRITON_DEVICE, requires_grad=True)
    dy = torch.randn(5, 7, device=TRITON_DEVICE)
    got = []
    for apply in (norms._APPLY, norms.LayerNormFunction.apply):
        out = apply(x, (7,), w, b, 1e-5)
        assert type(out.grad_fn).__name__ == "LayerNormFunctionBackward"
        got.append((out.detach(), *torch.autograd.grad(out, (x, w, b), dy)))
    assert len(cpu_kernel) == 2
    for a, c in zip(*got):
        assert torch.equal(a, c)
    for g, want in zip(got[0][1:], reference_grads(x, (7,), w, b, 1e-5, dy)):
        assert_rel(g, want, TOL[torch.float32])


class Net(nn.Module):
    """LayerNorms with dropout between them, a plain nn.Module elsewhere."""

    def __init__(self, d: int = 10, device: str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, d)
        self.ln1 = nn.LayerNorm(d)
        self.drop = nn.Dropout(0.3)
        self.mid = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, bias=False)
        self.out = nn.Linear(d, 5)
        self.to(device)

    def forward(self, x):
        return self.out(self.ln2(torch.tanh(self.mid(self.drop(self.ln1(self.inp(x)))))))


class Sub(nn.LayerNorm):  # a subclass may override forward: never swapped
    pass


def test_model_norms_and_swap(cpu_kernel, monkeypatch):
    m = Net(device=TRITON_DEVICE)
    m.sub = Sub(10, device=TRITON_DEVICE)
    assert norms.model_norms(m) == [m.ln1, m.ln2]
    m.ln2.forward = m.ln2.forward  # an instance forward (a wrapper's hook): left alone
    assert norms.model_norms(m) == [m.ln1]
    del m.ln2.forward
    hooked = []
    m.ln1.register_forward_hook(lambda mod, i, o: hooked.append(o.shape))
    x = torch.randn(3, 6, device=TRITON_DEVICE)
    with norms.fast_layer_norms(norms.model_norms(m)):
        assert type(m.ln1) is norms.OnePassLayerNorm and type(m.ln2) is norms.OnePassLayerNorm
        with norms.fast_layer_norms([m.ln1]):  # nested: left to the outer window
            pass
        assert type(m.ln1) is norms.OnePassLayerNorm
        m.eval()
        m(x).sum().backward()
    assert type(m.ln1) is nn.LayerNorm and type(m.ln2) is nn.LayerNorm
    assert hooked == [(3, 10)] and len(cpu_kernel) == 2
    # restored after an exception, and nothing swapped under the switch off or on a compiled model
    with pytest.raises(KeyError), norms.fast_layer_norms([m.ln1]):
        raise KeyError
    assert type(m.ln1) is nn.LayerNorm
    monkeypatch.setattr(norms, "ENABLED", False)
    assert norms.model_norms(m) == []
    monkeypatch.setattr(norms, "ENABLED", True)
    m.mid.forward = torch.compile(m.mid.forward)
    assert norms.model_norms(m) == []


def test_copies_made_in_a_window_run_on_their_own_weights(cpu_kernel):
    """nn.DataParallel's replicas and a deepcopy made while the norms are swapped keep the swapped
    class: they must compute with their own weights, and take the kernel only inside a window."""
    import copy

    m = Net(device=TRITON_DEVICE)
    x = torch.randn(3, 6, device=TRITON_DEVICE)
    with norms.fast_layer_norms(norms.model_norms(m)):
        replica = m.ln1._replicate_for_data_parallel()
        clone = copy.deepcopy(m)
    for other in (replica, clone.ln1):
        assert type(other) is norms.OnePassLayerNorm
    # (as DataParallel's replicate does: the replica's parameters are its device's copies)
    replica.weight = nn.Parameter(torch.full((10,), 3.0, device=TRITON_DEVICE))
    replica.bias = nn.Parameter(torch.full((10,), -1.0, device=TRITON_DEVICE))
    h = torch.randn(3, 10, device=TRITON_DEVICE)
    assert torch.equal(replica(h), F.layer_norm(h, (10,), replica.weight, replica.bias, replica.eps))
    clone(x).sum().backward()  # outside any window: PyTorch's backward
    assert not cpu_kernel
    with norms.fast_layer_norms([]):  # inside one: the kernel
        clone(x).sum().backward()
    assert len(cpu_kernel) == 2


def test_data_parallel_devices_are_replayed():
    """nn.DataParallel's replicas draw dropout on each of its devices: their random state is
    captured too (its devices set by hand: this machine may have no GPU)."""
    from bigbatch.gradcache.rng import model_cuda_devices

    dp = nn.DataParallel(Net())
    dp.device_ids = [0, 1]
    assert model_cuda_devices(dp) == [0, 1]
    assert model_cuda_devices(nn.Sequential(Net())) == []


def test_on_by_default():
    code = "from bigbatch.gradcache import norms; print(norms.ENABLED)"  # a fresh process's default
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


@pytest.fixture
def fresh_availability(monkeypatch):
    """``kernel_available`` deciding afresh (its per-device memo emptied), the swap on CPU tensors."""
    monkeypatch.setattr(norms, "_AVAILABLE", {})
    monkeypatch.setattr(norms, "on_kernel_device", lambda t: t.device.type == TRITON_DEVICE)
    monkeypatch.setattr(norms, "ENABLED", True)


def test_self_test_runs_the_kernel_once_per_device(fresh_availability, monkeypatch):
    """The kernel is compiled, launched and checked against float64 once per device; its verdict
    is kept."""
    runs = []
    real = norms._self_test
    monkeypatch.setattr(norms, "_self_test", lambda device: runs.append(device) or real(device))
    m = Net(device=TRITON_DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning where it runs)
        assert norms.model_norms(m) == [m.ln1, m.ln2]
        assert norms.model_norms(m) == [m.ln1, m.ln2]
    assert len(runs) == 1 and list(norms._AVAILABLE.values()) == [True]


def test_self_test_whatever_the_callers_modes(fresh_availability):
    """Inference mode, no grad, CPU autocast and another default device around the first call do
    not fail the self-test (which would keep PyTorch's norm with a wrong warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), torch.device("meta"):
            assert norms.kernel_available(torch.device(TRITON_DEVICE))
    assert norms._self_test(torch.device(TRITON_DEVICE)) is None


def test_self_test_refuses_a_gpu_before_ampere(fresh_availability, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (no capture to ask about here)
    with pytest.warns(RuntimeWarning, match=r"compute capability \(7, 5\), below 8.0"):
        assert not norms.kernel_available(torch.device("cuda", 0))
    assert norms._AVAILABLE == {("cuda", 0): False}


def test_self_test_reference_and_its_side_effects(fresh_availability, monkeypatch):
    """The closed-form reference equals autograd's float64 gradients; the self-test runs no autograd
    (a caller's saved-tensor hooks see nothing) and calls the kernel twice (on CUDA: through Triton's
    JIT, then its compiled runner)."""
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(5, 9, generator=g, dtype=F64), torch.randn(5, 9, generator=g, dtype=F64)
    w = torch.randn(9, generator=g, dtype=F64)
    want = reference_grads(x.requires_grad_(), (9,), w.requires_grad_(), torch.zeros(9, dtype=F64, requires_grad=True),
                           1e-5, dy)
    for a, b in zip(norms._reference_grads(x.detach(), dy, w.detach(), 1e-5), want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    calls, real = [], norm_kernel.layer_norm_backward
    monkeypatch.setattr(norm_kernel, "layer_norm_backward", lambda *a: calls.append(1) or real(*a))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        assert norms._self_test(torch.device(TRITON_DEVICE)) is None
    assert packed == [] and calls == [1, 1]


def test_self_test_waits_out_transforms_and_dispatch_modes(fresh_availability):
    """Asked inside vmap / torch.func.grad / a fake-tensor mode (where a self-test fails for reasons
    of its own): no for that call, nothing kept, no warning; asked again outside: it runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dev = torch.device(TRITON_DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not torch.vmap(lambda t: t * norms.kernel_available(dev))(torch.ones(2)).any()
        assert torch.func.grad(lambda t: (t * (0.0 if norms.kernel_available(dev) else 1.0)).sum())(torch.ones(2)).all()
        with FakeTensorMode():
            assert not norms.kernel_available(dev)
        assert norms._AVAILABLE == {}
        assert norms.kernel_available(dev) and len(norms._AVAILABLE) == 1


def test_a_failing_self_test_is_kept_when_its_warning_raises(fresh_availability, monkeypatch):
    runs = []

    def broken(*args, **kwargs):
        runs.append(1)
        raise RuntimeError("Failed to find C compiler.")

    monkeypatch.setattr(norm_kernel, "layer_norm_backward", broken)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (python -W error, pytest's filterwarnings=error)
        with pytest.raises(RuntimeWarning):
            norms.kernel_available(torch.device(TRITON_DEVICE))
        assert not norms.kernel_available(torch.device(TRITON_DEVICE))
    assert runs == [1]


def test_an_incoming_gradient_the_kernel_cannot_read_takes_pytorchs_backward(cpu_kernel):
    """A tensor-subclass gradient reaching the norm (its output multiplied by a wrapper subclass
    downstream) is differentiated by PyTorch, as by the unswapped norm."""
    two = pytest.importorskip("torch.testing._internal.two_tensor")
    ln = nn.LayerNorm(6).to(TRITON_DEVICE)
    x = torch.randn(4, 6, device=TRITON_DEVICE, requires_grad=True)
    scale = two.TwoTensor(torch.randn(4, 6, device=TRITON_DEVICE), torch.randn(4, 6, device=TRITON_DEVICE))
    grads = []
    for swap in ([ln], []):
        with norms.fast_layer_norms(swap):
            (ln(x) * scale).sum().backward()
        grads.append([t.grad for t in (x, ln.weight, ln.bias)])
        for t in (x, ln.weight, ln.bias):
            t.grad = None
    assert not cpu_kernel
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("failure", ["import", "launch", "wrong", "rocm"])
def test_where_the_kernel_cannot_run_pytorchs_norm_is_kept(fresh_availability, monkeypatch, failure):
    """No Triton, a Triton that imports but cannot launch (no C compiler to build its launcher, as
    in slim images), a kernel whose gradients are off: the norms are not swapped and a warning says
    why, once per device; on ROCm (untested) quietly. The step then equals PyTorch's."""
    def broken(*args, **kwargs):
        if failure == "import":
            raise ImportError("No module named 'triton'")
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    if failure == "import":
        monkeypatch.setattr(norms, "_kernel", broken)
    elif failure == "launch":
        monkeypatch.setattr(norm_kernel, "layer_norm_backward", broken)
    elif failure == "wrong":
        real = norm_kernel.layer_norm_backward
        monkeypatch.setattr(norm_kernel, "layer_norm_backward", lambda *a: tuple(g * 1.01 for g in real(*a)))
    else:
        monkeypatch.setattr(torch.version, "hip", "6.2")
    m = Net(device=TRITON_DEVICE)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert norms.model_norms(m) == [] and norms.model_norms(m) == []
    assert len(got) == (0 if failure == "rocm" else 1), [str(w.message) for w in got]
    if got:
        assert "one-pass LayerNorm backward cannot run" in str(got[0].message)
        assert ("differ from float64" if failure == "wrong" else "Error: ") in str(got[0].message)
    x = torch.randn(4, 6, device=TRITON_DEVICE)
    loss = lambda a, b: F.cross_entropy(a @ b.T, torch.arange(4, device=TRITON_DEVICE))

    def step():
        m.zero_grad()
        torch.manual_seed(0)
        GradCache(m, 2, loss)(x, x + 1)
        return [p.grad.clone() for p in m.parameters()]

    swapped_off = step()
    monkeypatch.setattr(norms, "ENABLED", False)
    assert all(torch.equal(a, b) for a, b in zip(swapped_off, step()))


def test_library_swaps_only_cuda_weights():
    m = Net()
    assert norms.model_norms(m) == []  # CPU weights: PyTorch's backward, untouched
    x = torch.randn(3, 10, requires_grad=True)
    assert not norms.kernel_applies(m.ln1, x)


def clip(q, p):
    s = 4.0 * F.normalize(q, dim=-1) @ F.normalize(p, dim=-1).T
    t = torch.arange(len(q), device=q.device)
    return (F.cross_entropy(s, t) + F.cross_entropy(s.T, t)) / 2


def _full_batch(m, q, p, seed):
    """The full-batch gradients under the masks GradCache's chunks draw: from the same seed, the
    same chunks (of 4 rows, queries first) in one graph, with PyTorch's LayerNorm backward."""
    torch.manual_seed(seed)
    outs = [torch.cat([m(x[i:i + 4]) for i in range(0, len(x), 4)]) for x in (q, p)]
    clip(*outs).backward()
    return [t.grad.clone() for t in m.parameters()]


@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_engine_runs_the_kernel_exactly(cpu_kernel, api, checkpoint):
    """A GradCache step / cached_encode with the swap on (CPU): the kernel ran in every re-run
    chunk's backward, and the gradients equal the full batch's under the same dropout masks --
    with the model's own non-reentrant activation checkpointing too (its recompute inside the
    backward must take the swapped path, or its saved tensors differ from the forward's)."""
    m = Net(device=TRITON_DEVICE)
    if checkpoint:
        inner = m.forward
        m.forward = lambda x: torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)
    g = torch.Generator().manual_seed(3)
    q, p = (torch.randn(9, 6, generator=g).to(TRITON_DEVICE) for _ in range(2))
    ref = _full_batch(m, q, p, 11)
    m.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    if api == "gradcache":
        GradCache(m, 4, clip)(q, p)
    else:
        clip(cached_encode(m, q, 4), cached_encode(m, p, 4)).backward()
    assert len(cpu_kernel) == 2 * 6  # two LayerNorms in each of the 6 re-run chunks
    for name, (t, r) in zip([n for n, _ in m.named_parameters()], zip(m.parameters(), ref)):
        assert_rel(t.grad, r, 1e-5, name)


def test_functional_cached_runs_the_kernel(cpu_kernel):
    """The functional ``cached``: each closure's re-run takes the kernel, and the gradients equal
    the same sub-batches run with one graph (PyTorch's LayerNorm backward)."""
    from bigbatch.gradcache import cached

    m = Net(device=TRITON_DEVICE)
    g = torch.Generator().manual_seed(5)
    batches = [[torch.randn(4, 6, generator=g).to(TRITON_DEVICE) for _ in range(2)] for _ in range(2)]
    torch.manual_seed(8)
    outs = [[m(b[0]), m(b[1])] for b in batches]  # the cached loop's order: the same dropout draws
    clip(torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])).backward()
    ref = [t.grad.clone() for t in m.parameters()]
    m.zero_grad(set_to_none=True)

    @cached
    def encode(model, x):
        return model(x)

    torch.manual_seed(8)
    reps, closures = [[], []], []
    for b in batches:
        for k in (0, 1):
            r, f = encode(m, b[k])
            reps[k].append(r)
            closures.append((r, f))
    clip(torch.cat(reps[0]), torch.cat(reps[1])).backward()
    for r, f in closures:
        f(r)
    assert len(cpu_kernel) == 2 * 4
    for t, r in zip(m.parameters(), ref):
        assert_rel(t.grad, r, 1e-5, "functional cached")


def test_kept_chunk_runs_the_kernel(cpu_kernel):
    """A chunk whose pass-1 graph is kept (memory budget) builds it through the swapped forward."""
    m = Net(device=TRITON_DEVICE)
    g = torch.Generator().manual_seed(4)
    q, p = (torch.randn(12, 6, generator=g).to(TRITON_DEVICE) for _ in range(2))
    torch.manual_seed(2)
    gc = GradCache(m, loss_fn=clip, memory_budget=torch.cuda.memory_allocated() + 2**30 if TRITON_DEVICE == "cuda" else "1GiB")
    gc(q, p)
    assert gc.last_kept >= 1
    assert cpu_kernel, "the kept graph's backward did not run the kernel"


def _bert(device, dropout=0.2):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=96, num_hidden_layers=2, num_attention_heads=4, intermediate_size=192, vocab_size=500,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertModel(cfg).to(device).train()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_autocast_swap_is_the_module_forward(dtype, monkeypatch):
    """Under CUDA autocast the swapped forward gives the module's own output bitwise (autocast's
    fp32 policy for layer_norm applies inside the Function as outside), and gradients within
    rounding of float64's."""
    monkeypatch.setattr(norms, "ENABLED", True)  # (the default, set against a test that turned it off)
    ln = nn.LayerNorm(768).cuda()
    nn.init.normal_(ln.weight, 1.0, 0.2)
    nn.init.normal_(ln.bias, 0.0, 0.2)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 300, 768, generator=g) * 3 + 1).cuda().to(dtype).requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        plain = ln(x)
        assert norms.model_norms(ln) == [ln]
        with norms.fast_layer_norms([ln]):
            fast = ln(x)
    assert fast.dtype == plain.dtype and torch.equal(fast, plain)
    assert fast.grad_fn is not None and "LayerNormFunction" in type(fast.grad_fn).__name__
    dy = torch.randn(fast.shape, generator=g).cuda().to(fast.dtype)
    fast.backward(dy)
    refs = reference_grads(x, (768,), ln.weight, ln.bias, ln.eps, dy)
    assert_close(x.grad, refs[0], 1e-2, 1e-3, "dx")  # rounded to the input's half dtype
    assert_rel(ln.weight.grad, refs[1], 1e-5, "dw")
    assert_rel(ln.bias.grad, refs[2], 1e-5, "db")


@pytest.mark.gpu
def test_cuda_bert_step_with_and_without_kernel(monkeypatch):
    """GradCache steps of a small BERT (dropout off: the masks of fp32 and bf16 tensors differ),
    with its LayerNorms swapped and with PyTorch's backward: in fp32 the two agree within fp32
    rounding; under bf16 autocast the kernel's step is as close to the fp32 step as PyTorch's
    (each differs from it by bf16's rounding; they differ from each other by flipped bf16
    roundings, not by less)."""
    m = _bert("cuda", dropout=0.0)
    g = torch.Generator().manual_seed(1)
    q = {"input_ids": torch.randint(5, 500, (24, 16), generator=g).cuda()}
    p = {"input_ids": torch.randint(5, 500, (24, 40), generator=g).cuda()}
    rep = lambda out: out.last_hidden_state[:, 0]
    assert norms.kernel_available(torch.device("cuda", torch.cuda.current_device()))  # (its self-test: before the count)
    calls = []
    real = norm_kernel.layer_norm_backward
    monkeypatch.setattr(norm_kernel, "layer_norm_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = {}
    for amp in (None, torch.bfloat16):
        for on in (True, False):
            monkeypatch.setattr(norms, "ENABLED", on)
            m.zero_grad(set_to_none=True)
            GradCache(m, 8, clip, get_rep_fn=rep, autocast_dtype=amp)(q, p)
            got[amp, on] = torch.cat([t.grad.flatten() for t in m.parameters() if t.grad is not None])
            assert len(calls) == (6 * 5 if on else 0), len(calls)  # 6 re-run chunks x 5 LayerNorms
            calls.clear()
    ref = got[None, False]
    assert_rel(got[None, True], ref, 1e-5, "fp32 step, kernel vs PyTorch's LayerNorm backward")
    from helpers import rel_err

    err_kernel, err_plain = rel_err(got[torch.bfloat16, True], ref), rel_err(got[torch.bfloat16, False], ref)
    assert err_kernel <= 1.25 * err_plain + 1e-5, (err_kernel, err_plain)


def test_compiled_function_inside_a_forward_takes_pytorchs_path(cpu_kernel):
    """A torch.compile'd function called inside an uncompiled forward (invisible to model_norms)
    traces the swapped norm as PyTorch's layer norm."""
    ln = nn.LayerNorm(6).to(TRITON_DEVICE)
    fn = torch.compile(lambda v: ln(v).sum(), backend="eager")
    x = torch.randn(3, 6, device=TRITON_DEVICE, requires_grad=True)
    with norms.fast_layer_norms([ln]):
        fn(x).backward()
    assert not cpu_kernel
    want = torch.autograd.grad(F.layer_norm(x, (6,), ln.weight, ln.bias).sum(), x)[0]
    assert torch.allclose(x.grad, want, atol=1e-6)


def test_transform_over_other_inputs_and_batched_backward(cpu_kernel):
    """A torch.func transform running over other inputs than the norm's (the Function would be
    refused inside any), and a vmapped first-order backward (is_grads_batched: a batched dy the
    kernel cannot take) give PyTorch's results. (Found by a review.)"""
    ln = nn.LayerNorm(5).to(TRITON_DEVICE)
    h = torch.randn(3, 5, device=TRITON_DEVICE)
    z = torch.randn(3, 5, device=TRITON_DEVICE)
    with norms.fast_layer_norms([ln]):
        got = torch.func.grad(lambda v: (ln(h) * v).sum())(z)
    assert torch.allclose(got, F.layer_norm(h, (5,), ln.weight, ln.bias).detach())
    x = torch.randn(3, 5, device=TRITON_DEVICE, requires_grad=True)
    eye = torch.eye(15, device=TRITON_DEVICE).view(15, 3, 5)
    with norms.fast_layer_norms([ln]):
        out = ln(x)
        assert "LayerNormFunction" in type(out.grad_fn).__name__
        (jac,) = torch.autograd.grad(out, x, eye, is_grads_batched=True)
    want = torch.autograd.functional.jacobian(lambda v: F.layer_norm(v, (5,), ln.weight, ln.bias), x.detach())
    assert torch.allclose(jac, want.reshape(15, 3, 5), atol=1e-5)


class Jagged(nn.Module):
    """Padding removed inside the forward: the LayerNorm runs on a nested (jagged) tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 8)
        self.ln = nn.LayerNorm(8)
        self.to(TRITON_DEVICE)

    def forward(self, ids, lengths):
        h = self.emb(ids)
        mask = torch.arange(ids.shape[1], device=ids.device) < lengths[:, None]
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        v = self.ln(torch.nested.nested_tensor_from_jagged(h[mask], offsets)).values()
        seg = torch.repeat_interleave(torch.arange(len(lengths), device=ids.device), lengths)
        return torch.zeros(len(lengths), 8, device=ids.device).index_add(0, seg, v) / lengths[:, None]


def test_nested_and_subclass_tensors_take_pytorchs_norm(cpu_kernel, monkeypatch):
    """A nested (jagged) input, a tensor subclass input or weight (a DTensor is one) -- whose
    backward would hand the kernel what it cannot read -- take PyTorch's norm: the GradCache step
    with a jagged LayerNorm equals the one with the kernel off."""
    m = Jagged()
    g = torch.Generator().manual_seed(1)
    q, p = ({"ids": torch.randint(0, 50, (8, 6), generator=g).to(TRITON_DEVICE),
             "lengths": torch.randint(1, 7, (8,), generator=g).to(TRITON_DEVICE)} for _ in range(2))
    loss = lambda a, b: F.cross_entropy(a @ b.T, torch.arange(len(a), device=a.device))

    def step():
        m.zero_grad()
        GradCache(m, 4, loss)(q, p)
        return [t.grad.clone() for t in m.parameters()]

    with_swap = step()
    assert not cpu_kernel and norms.model_norms(m) == [m.ln]
    monkeypatch.setattr(norms, "ENABLED", False)
    assert all(torch.equal(a, b) for a, b in zip(with_swap, step()))

    class Sub(torch.Tensor):
        pass

    ln = nn.LayerNorm(8).to(TRITON_DEVICE)
    x = torch.randn(3, 8, device=TRITON_DEVICE)
    assert norms.kernel_applies(ln, x) and not norms.kernel_applies(ln, x.as_subclass(Sub))
    ln.weight = nn.Parameter(torch.ones(8, device=TRITON_DEVICE).as_subclass(Sub))
    assert type(ln.weight) is Sub and not norms.kernel_applies(ln, x)
    monkeypatch.setattr(norms, "ENABLED", True)
    assert norms.model_norms(ln) == []


DTENSOR_STEP = """
import os, socket, sys
import torch, torch.nn as nn
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from bigbatch.gradcache import norms
norms.on_kernel_device = lambda t: True
norms.kernel_available = lambda device: True
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
ln = nn.LayerNorm(8)
distribute_module(ln, mesh)
x = distribute_tensor(torch.randn(4, 6, 8), mesh, [Shard(1)]).requires_grad_()
ln(x).to_local().square().sum().backward()
want = ln.weight.grad.to_local().clone()
ln.zero_grad()
with norms.fast_layer_norms(norms.model_norms(ln) or [ln]):
    ln(x).to_local().square().sum().backward()
assert torch.equal(ln.weight.grad.to_local(), want)
dist.destroy_process_group()
print("ok")
"""


def test_dtensor_layer_norm_takes_pytorchs_norm():
    """Tensor parallelism's replicated norm weights on sharded activations (DTensors): not swapped,
    and even a swapped module differentiates them with PyTorch's norm (a subprocess: its own group)."""
    pytest.importorskip("torch.distributed.tensor")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", DTENSOR_STEP], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
