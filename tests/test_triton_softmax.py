"""The fused Triton backend against float64 references.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest) at
small shapes with small blocks, so several tiles, groups and super-tiles, masked tails and D
chunks are all exercised. Tests marked ``gpu`` run the real kernels (tuned blocks, bf16 on
tensor cores) on a CUDA device against the issue's tolerances.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import bigbatch
from bigbatch import reference
from bigbatch.backends import resolve_backend

triton = pytest.importorskip("triton")
from bigbatch.backends.triton_softmax import TritonTiles  # noqa: E402
import triton.language as tl  # noqa: E402

from helpers import TRITON_DEVICE, assert_rel, features, rel_err  # noqa: E402

DEVICE = TRITON_DEVICE
# Small tiles on the CPU: several row/col blocks, groups and D chunks at B <= 70.
SMALL = dict(block_m=16, block_n=16, block_d=16, super_tile=(40, 24))


def _ref_stats(q, k, s):
    logits = s * (q.double() @ k.double().t())
    return logits, logits.logsumexp(1), logits.logsumexp(0)


def _ref_grad(q, k, s, g_row, g_col):
    logits, lr, lc = _ref_stats(q, k, s)
    ds = torch.zeros_like(logits)
    if g_row is not None:
        ds += torch.exp(logits - lr[:, None]) * g_row.double()[:, None]
    if g_col is not None:
        ds += torch.exp(logits - lc[None, :]) * g_col.double()[None, :]
    qk = q.double() @ k.double().t()
    return s * ds @ k.double(), s * ds.t() @ q.double(), (ds * qk).sum()


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3 if DEVICE == "cpu" else 5e-3, torch.bfloat16: 1e-2}[dtype]


def _scale_tol(dtype):
    """d_scale: fp32 products under the interpreter; on a GPU, half inputs meet a half-precision
    dS workspace in the tensor-core products (the GPU tests' tolerances)."""
    return 1e-5 if DEVICE == "cpu" or dtype == torch.float32 else 1e-3


def _data(b, n, d, dtype, seed=0, normalize=True):
    q = features(b, d, dtype=dtype, device=DEVICE, seed=seed, normalize=normalize).detach()
    k = features(n, d, dtype=dtype, device=DEVICE, seed=seed + 1, normalize=normalize).detach()
    return q, k


# ----------------------------------------------------------------------------- interpreter (CPU) tests
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,n,d", [(70, 70, 40), (33, 17, 7), (1, 5, 1), (48, 64, 32)])
def test_lse_both_directions(dtype, b, n, d):
    q, k = _data(b, n, d, dtype, seed=b + n + d)
    s = torch.tensor(7.5, device=DEVICE)
    lr, lc = TritonTiles(precision="ieee", **SMALL).lse(q, k, s, rows=True, cols=True)
    _, ref_r, ref_c = _ref_stats(q, k, 7.5)
    assert lr.dtype == lc.dtype == torch.float32
    assert_rel(lr, ref_r, 1e-6, "lse_row")
    assert_rel(lc, ref_c, 1e-6, "lse_col")


@pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
def test_lse_one_direction(rows, cols):
    q, k = _data(21, 50, 19, torch.float32)
    s = torch.tensor(2.0, device=DEVICE)
    lr, lc = TritonTiles(precision="ieee", **SMALL).lse(q, k, s, rows=rows, cols=cols)
    _, ref_r, ref_c = _ref_stats(q, k, 2.0)
    assert (lr is None) != rows and (lc is None) != cols
    if rows:
        assert_rel(lr, ref_r, 1e-6, "lse_row")
    if cols:
        assert_rel(lc, ref_c, 1e-6, "lse_col")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("which", ["both", "rows", "cols"])
def test_lse_grad(dtype, which):
    b, n, d = 45, 53, 21
    q, k = _data(b, n, d, dtype, seed=3)
    s = torch.tensor(5.0, device=DEVICE)
    be = TritonTiles(precision="ieee", **SMALL)
    lr, lc = be.lse(q, k, s, rows=True, cols=True)
    g = torch.Generator().manual_seed(1)
    g_row = torch.rand(b, generator=g).to(DEVICE) if which != "cols" else None
    g_col = torch.rand(n, generator=g).to(DEVICE) if which != "rows" else None
    dq, dk, d_s = be.lse_grad(q, k, s, lr, lc, g_row, g_col)
    ref_dq, ref_dk, ref_ds = _ref_grad(q, k, 5.0, g_row, g_col)
    assert dq.dtype == dk.dtype == dtype and d_s.dtype == torch.float32 and d_s.dim() == 0
    tol = _tol(dtype)
    assert_rel(dq, ref_dq, tol, "dq")
    assert_rel(dk, ref_dk, tol, "dk")
    assert_rel(d_s, ref_ds, _scale_tol(dtype), "d_scale")
    # grad_dtype=float32 (the ring's partial sums) gives the unrounded accumulators.
    dq32, dk32, _ = be.lse_grad(q, k, s, lr, lc, g_row, g_col, grad_dtype=torch.float32)
    assert dq32.dtype == dk32.dtype == torch.float32
    tol32 = 1e-5 if DEVICE == "cpu" or dtype == torch.float32 else tol  # GPU: half dS in the products
    assert_rel(dq32, ref_dq, tol32, "dq fp32")
    assert_rel(dk32, ref_dk, tol32, "dk fp32")


@pytest.mark.parametrize(
    "tune",
    [{}, {"one_exp": 1}, {"ds_one_exp": 1}, {"col_ref": 0}, {"col_ref": 0, "one_exp": 1}, {"kmajor": 1},
     {"products": "pair"}, {"products": "pair", "kmajor": 1}, {"products": "cublas"}],
    ids=str,
)
@pytest.mark.parametrize("spread", [False, True], ids=["close", "spread"])
def test_kernel_variants(tune, spread):
    """Every kernel variant, on data whose tiles take the one-exp fast path (close) and on data
    whose column maxima sit far below the tile max (spread: the exact two-exp fallback)."""
    if DEVICE == "cuda" and tune.get("products") == "cublas":
        pytest.skip("fp32 features with cuBLAS products are refused on a GPU (test_gpu_cublas_products_refuse_fp32)")
    b, n, d = 37, 45, 19
    q, k = _data(b, n, d, torch.float32, seed=21)
    if spread:
        q, k = q.abs(), k.clone()
        k[::3] = -30 * k[::3].abs()  # every third key: all its logits far below the rest
    s = torch.tensor(6.0, device=DEVICE)
    be = TritonTiles(precision="ieee", block_m=16, block_n=16, block_d=16, super_tile=(24, 40), tune=tune)
    lr, lc = be.lse(q, k, s, rows=True, cols=True)
    _, ref_r, ref_c = _ref_stats(q, k, 6.0)
    assert_rel(lr, ref_r, 1e-6, "lse_row")
    assert_rel(lc, ref_c, 1e-6, "lse_col")
    g = torch.Generator().manual_seed(2)
    g_row, g_col = torch.rand(b, generator=g).to(DEVICE), torch.rand(n, generator=g).to(DEVICE)
    dq, dk, d_s = be.lse_grad(q, k, s, lr, lc, g_row, g_col)
    ref_dq, ref_dk, ref_ds = _ref_grad(q, k, 6.0, g_row, g_col)
    assert_rel(dq, ref_dq, 1e-4 if spread else 1e-5, "dq")
    assert_rel(dk, ref_dk, 1e-4 if spread else 1e-5, "dk")
    assert_rel(d_s, ref_ds, 1e-4 if spread else 1e-5, "d_scale")


@pytest.mark.parametrize("tune", [{}, {"col_ref": 0}, {"one_exp": 1}], ids=str)
@pytest.mark.parametrize("jumps", [False, True], ids=["smooth", "jumps"])
def test_even_shapes_and_column_reference(tune, jumps):
    """Shapes that divide every block (the unmasked EVEN path) and many row blocks per program, so
    later tiles reuse the running column partial as reference; 'jumps' makes later row blocks
    exceed the earlier partials by far more than 2^64 (the exact two-reduction path)."""
    b, n, d = 128, 96, 32
    q, k = _data(b, n, d, torch.float32, seed=31)
    if jumps:
        q[64:] *= 40.0  # rows of the later row blocks: logits ~ 40x larger
    s = torch.tensor(8.0, device=DEVICE)
    be = TritonTiles(precision="ieee", block_m=16, block_n=16, block_d=16, tune={**tune, "programs": 2})
    lr, lc = be.lse(q, k, s, rows=True, cols=True)
    _, ref_r, ref_c = _ref_stats(q, k, 8.0)
    assert_rel(lr, ref_r, 1e-6, "lse_row")
    assert_rel(lc, ref_c, 1e-6, "lse_col")
    bad = q.clone()
    bad[77, 3] = float("nan")
    lr, lc = be.lse(bad, k, s, rows=True, cols=True)
    assert torch.isnan(lr[77]) and torch.isnan(lc).all() and not torch.isnan(lr[:77]).any()


@pytest.mark.parametrize("products", ["separate", "pair", "cublas"])
def test_products_take_half_features(products):
    """fp16 features meet a workspace of another dtype in the products (the right operand is
    converted once per super-tile); every product path agrees with float64."""
    b, n, d = 40, 52, 24
    q, k = _data(b, n, d, torch.float16, seed=41)
    s = torch.tensor(7.0, device=DEVICE)
    be = TritonTiles(block_m=16, block_n=16, block_d=16, super_tile=(24, 32), tune={"products": products})
    lr, lc = be.lse(q, k, s, rows=True, cols=True)
    g = torch.Generator().manual_seed(3)
    g_row, g_col = torch.rand(b, generator=g).to(DEVICE), torch.rand(n, generator=g).to(DEVICE)
    dq, dk, d_s = be.lse_grad(q, k, s, lr, lc, g_row, g_col)
    ref_dq, ref_dk, ref_ds = _ref_grad(q, k, 7.0, g_row, g_col)
    assert dq.dtype == dk.dtype == torch.float16
    assert_rel(dq, ref_dq, 2e-3, "dq")
    assert_rel(dk, ref_dk, 2e-3, "dk")
    assert_rel(d_s, ref_ds, 1e-4 if DEVICE == "cpu" else 1e-3, "d_scale")


def test_lse_grad_no_direction_is_zero():
    q, k = _data(9, 11, 5, torch.float32)
    s = torch.tensor(1.0, device=DEVICE)
    dq, dk, d_s = TritonTiles().lse_grad(q, k, s, None, None, None, None)
    assert dq.shape == q.shape and dk.shape == k.shape
    assert dq.abs().sum() == 0 and dk.abs().sum() == 0 and d_s.item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_clip_loss_end_to_end(dtype):
    b, d = 67, 37
    q = features(b, d, dtype=dtype, device=DEVICE, seed=11)
    k = features(b, d, dtype=dtype, device=DEVICE, seed=12)
    scale = torch.tensor(math.log(1 / 0.07), device=DEVICE, requires_grad=True)
    loss = bigbatch.clip_loss(q, k, scale.exp(), backend=TritonTiles(precision="ieee", **SMALL))
    loss.backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    s64 = scale.detach().double().requires_grad_()
    ref = reference.clip_loss(q64, k64, s64.exp())
    ref.backward()
    tol = _tol(dtype)
    assert_rel(loss, ref, 1e-6 if dtype == torch.float32 else 1e-3, "loss")
    assert_rel(q.grad, q64.grad, tol, "d image")
    assert_rel(k.grad, k64.grad, tol, "d text")
    assert_rel(scale.grad, s64.grad, 1e-4 if dtype == torch.float32 else 1e-2, "d scale")


def test_infonce_extra_keys_and_labels():
    b, n, d = 23, 61, 13
    q = features(b, d, device=DEVICE, seed=5)
    k = features(n, d, device=DEVICE, seed=6)
    labels = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:b].to(DEVICE)
    out = bigbatch.infonce_loss(q, k, 9.0, labels=labels, reduction="none", backend=TritonTiles(precision="ieee", **SMALL))
    gout = torch.linspace(0.1, 2.0, b, device=DEVICE)
    (out * gout).sum().backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref = reference.infonce_per_row(q64, k64, 9.0, labels)
    (ref * gout.double()).sum().backward()
    assert_rel(out, ref, 1e-6, "per-row loss")
    assert_rel(q.grad, q64.grad, 1e-5, "dq")
    assert_rel(k.grad, k64.grad, 1e-5, "dk")


def test_unnormalised_large_logits_exact():
    # |logits| up to ~1e4: a running max is required, and fp32 keeps relative accuracy.
    q, k = _data(40, 40, 24, torch.float32, seed=9, normalize=False)
    q, k = q * 4, k * 4
    q.requires_grad_(), k.requires_grad_()
    loss = bigbatch.clip_loss(q, k, 100.0, backend=TritonTiles(precision="ieee", **SMALL))
    loss.backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref = reference.clip_loss(q64, k64, 100.0)
    ref.backward()
    assert torch.isfinite(loss) and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert_rel(loss, ref, 1e-5, "loss")
    assert_rel(q.grad, q64.grad, 1e-3, "dq")
    assert_rel(k.grad, k64.grad, 1e-3, "dk")


@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_propagates(where):
    q, k = _data(30, 30, 9, torch.float32, seed=2)
    (q if where == "q" else k)[17, 4] = float("nan")
    q.requires_grad_(), k.requires_grad_()
    be = TritonTiles(**SMALL)
    lr, lc = be.lse(q.detach(), k.detach(), torch.tensor(3.0, device=DEVICE), rows=True, cols=True)
    assert torch.isnan(lr).any() and torch.isnan(lc).any()
    loss = bigbatch.clip_loss(q, k, 3.0, backend=be)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.isnan(q.grad).any() and torch.isnan(k.grad).any()


def test_non_contiguous_inputs():
    base_q, base_k = _data(44, 26, 30, torch.float32, seed=4)
    q = base_q.t().contiguous().t()[::2]  # column-major, then every other row
    k = base_k[:, ::2]  # strided columns
    q2 = base_q[::2].contiguous()
    s = torch.tensor(4.0, device=DEVICE)
    be = TritonTiles(precision="ieee", **SMALL)
    lr, lc = be.lse(q[:, :15], k, s, rows=True, cols=True)
    _, ref_r, ref_c = _ref_stats(q2[:, :15], k.contiguous(), 4.0)
    assert_rel(lr, ref_r, 1e-6, "lse_row")
    assert_rel(lc, ref_c, 1e-6, "lse_col")


@settings(max_examples=12, deadline=None)
@given(
    b=st.integers(1, 50),
    n=st.integers(1, 50),
    d=st.integers(1, 40),
    scale=st.floats(0.1, 60.0),
    seed=st.integers(0, 2**16),
)
@example(b=1, n=28, d=26, scale=56.296007114335104, seed=5511)
def test_property_random_shapes(b, n, d, scale, seed):
    q, k = _data(b, n, d, torch.float32, seed=seed, normalize=seed % 2 == 0)
    s = torch.tensor(scale, device=DEVICE)
    be = TritonTiles(precision="ieee", block_m=16, block_n=16, block_d=16, super_tile=(32, 32))
    lr, lc = be.lse(q, k, s, rows=True, cols=True)
    _, ref_r, ref_c = _ref_stats(q, k, scale)
    assert rel_err(lr, ref_r) <= 1e-5 and rel_err(lc, ref_c) <= 1e-5
    g = torch.Generator().manual_seed(seed)
    g_row, g_col = torch.randn(b, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
    dq, dk, d_s = be.lse_grad(q, k, s, lr, lc, g_row, g_col)
    ref_dq, ref_dk, ref_ds = _ref_grad(q, k, scale, g_row, g_col)
    # Gradients with signed upstream weights: compare against the reference's scale.
    assert (dq.double() - ref_dq).abs().max() <= 1e-4 * (1 + ref_dq.abs().max())
    assert (dk.double() - ref_dk).abs().max() <= 1e-4 * (1 + ref_dk.abs().max())
    # d_scale = sum_ij dS_ij (q k^T)_ij with signed dS cancels heavily: fp32 rounding is relative
    # to the size of the terms, not of the sum. And an fp32 LSE of logits ~|S| carries an absolute
    # error ~|S| * 2^-23, i.e. a relative error of that size in every probability: unnormalised
    # features at scale 60 reach |S| ~ 700 (found by hypothesis: b=1, n=28, d=26, seed=5511).
    logits, lr64, lc64 = _ref_stats(q, k, scale)
    ds64 = torch.exp(logits - lr64[:, None]) * g_row.double()[:, None] + torch.exp(logits - lc64[None, :]) * g_col.double()[None, :]
    terms = (ds64 * logits / scale).abs().sum().item()
    s_max = max(1.0, logits.abs().max().item() / 10)
    assert abs(d_s.item() - ref_ds.item()) <= 1e-4 * (1 + abs(ref_ds.item())) + 1e-6 * terms * s_max


def test_bad_arguments():
    with pytest.raises(ValueError, match="precision"):
        TritonTiles(precision="fp8")
    with pytest.raises(ValueError, match="block_m"):
        TritonTiles(block_m=24)
    with pytest.raises(ValueError, match="super_tile"):
        TritonTiles(super_tile=(0, 4))
    with pytest.raises(ValueError, match="tune"):
        TritonTiles(tune={"nope": 1})
    q, k = _data(4, 4, 3, torch.float64)
    with pytest.raises(TypeError, match="float64"):
        TritonTiles().lse(q, k, torch.tensor(1.0, dtype=torch.float64), rows=True, cols=False)
    q32, k16 = _data(4, 4, 3, torch.float32)[0], _data(4, 4, 3, torch.float16)[1]
    with pytest.raises(TypeError, match="dtype"):
        TritonTiles().lse(q32, k16, torch.tensor(1.0), rows=True, cols=False)


def test_registry_resolves_triton():
    be = resolve_backend("triton", torch.device(DEVICE))
    assert isinstance(be, TritonTiles) and be.supports(torch.device(DEVICE))


def test_ds_kernel_adds_the_positive_term_before_rounding_into_a_half_workspace():
    """Near convergence the positive term (-1/B at j = label_i) and the softmax terms (~P_ii/B)
    cancel to ~1e-2 of either: rounding the softmax terms to a bf16 workspace before adding the
    positive term lost ~20% of dS on the diagonal. On the CPU the backend's workspace is fp32, so
    the dS kernel is called here directly with a bf16 output: each entry must be the exact dS
    rounded once (one bf16 ulp, 2^-7: the interpreter truncates), the diagonal included."""
    from bigbatch.backends.triton_softmax_bwd import dlogits_kernel

    b, d, scale = 32, 16, 11.0
    g = torch.Generator().manual_seed(7)
    q = torch.nn.functional.normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=1)
    k = torch.nn.functional.normalize(q + 0.05 * torch.randn(b, d, generator=g, dtype=torch.float64), dim=1)
    logits = scale * q @ k.t()
    lse_r, lse_c = logits.logsumexp(1), logits.logsumexp(0)
    g_r = torch.full((b,), 0.5 / b, dtype=torch.float64)  # the CLIP mean: both directions, -1/B at the positive
    g_c = g_r.clone()
    g_p = torch.full((b,), -1.0 / b, dtype=torch.float64)
    want = (torch.exp(logits - lse_r[:, None]) * g_r[:, None] + torch.exp(logits - lse_c[None, :]) * g_c[None, :]
            + torch.diag(g_p))
    assert want.diag().abs().mean() < 0.05 / b  # near convergence: the diagonal cancels to a few %
    f32 = dict(dtype=torch.float32, device=DEVICE)
    ds = torch.full((b, b), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    sc = torch.tensor(scale, **f32)
    dlogits_kernel[(b // 16, b // 16)](
        q.to(**f32), k.to(**f32), sc, lse_r.to(**f32), lse_c.to(**f32), g_r.to(**f32), g_c.to(**f32),
        torch.arange(b, device=DEVICE), g_p.to(**f32), ds, ds, b, b, d, 0, d, d, b, 0,
        HAS_ROW=True, HAS_COL=True, HAS_POS=True, BLOCK_M=16, BLOCK_N=16, BLOCK_D=16,
        DOT_DTYPE=tl.float32, PRECISION="ieee", ONE_EXP=False, WRITE_T=False, EVEN=True,
    )
    err = (ds.double().cpu() - want).abs() / want.abs().clamp_min(1e-30)
    assert err.diag().max() < 2 ** -6 and err.max() < 2 ** -6, (err.diag().max().item(), err.max().item())


def test_interpreter_set_after_the_kernels_were_imported_is_refused_clearly(tmp_path):
    """Triton fixes at @triton.jit (the kernel module's import) whether a kernel is interpreted:
    TRITON_INTERPRET=1 set afterwards let CPU tensors through the device check into Triton's own
    "0 active drivers" RuntimeError. So do Triton's library functions at triton's import: kernels
    imported later under the interpreter fail in them ("Cannot call @triton.jit'd outside of the
    scope of a kernel"). The variable is read as Triton reads it ("false" is off). Fresh processes,
    which import triton without the variable."""
    import os
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(
        "import os, torch, bigbatch\n"
        "import bigbatch.backends.triton_sigmoid\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "q = torch.randn(4, 3)\n"
        "for call in (lambda: bigbatch.clip_loss(q, q, 2.0, backend='triton'),\n"
        "             lambda: bigbatch.siglip_loss(q, q, 2.0, 0.0, backend='triton')):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as exc:\n"
        "        print('refused:', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    refused = [line for line in out.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 2 and all("set after triton was imported" in r for r in refused), out.stdout + out.stderr[-2000:]

    off = tmp_path / "off.py"
    off.write_text(
        "import torch, bigbatch\n"
        "try:\n"
        "    bigbatch.clip_loss(torch.randn(4, 3), torch.randn(4, 3), 2.0, backend='triton')\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, str(off)], env={**env, "TRITON_INTERPRET": "false"}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "refused: backend='triton' needs CUDA tensors" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "set after" not in out.stdout


# ----------------------------------------------------------------------------- real GPU tests
GPU_CASES = [
    # dtype, precision, loss tol, grad tol
    (torch.bfloat16, "tf32", 1e-2, 1e-2),
    (torch.float16, "tf32", 1e-2, 1e-2),
    (torch.float32, "tf32", 2e-3, 2e-3),
    (torch.float32, "ieee", 1e-5, 1e-5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,precision,ltol,gtol", GPU_CASES)
@pytest.mark.parametrize("b,d", [(4099, 512), (5000, 129), (3000, 768), (1000, 1280)])
def test_gpu_clip_loss_vs_float64(dtype, precision, ltol, gtol, b, d):
    q = features(b, d, dtype=dtype, device="cuda", seed=b)
    k = features(b, d, dtype=dtype, device="cuda", seed=b + 1)
    logit = torch.tensor(math.log(1 / 0.07), device="cuda", requires_grad=True)
    # A small super-tile so that several dS workspaces, tails included, are used.
    be = TritonTiles(precision=precision, super_tile=(1536, 2560))
    loss = bigbatch.clip_loss(q, k, logit.exp(), backend=be)
    loss.backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    l64 = logit.detach().double().requires_grad_()
    ref = reference.clip_loss(q64, k64, l64.exp())
    ref.backward()
    assert_rel(loss, ref, ltol, "loss")
    assert_rel(q.grad, q64.grad, gtol, "d image")
    assert_rel(k.grad, k64.grad, gtol, "d text")
    assert_rel(logit.grad, l64.grad, gtol, "d logit_scale")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_unnormalised_scale_100(dtype):
    q = features(4096, 512, dtype=dtype, device="cuda", seed=1, normalize=False)
    k = features(4096, 512, dtype=dtype, device="cuda", seed=2, normalize=False)
    loss = bigbatch.clip_loss(q, k, 100.0, backend="triton")
    loss.backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref = reference.clip_loss(q64, k64, 100.0)
    ref.backward()
    assert torch.isfinite(loss) and torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert_rel(loss, ref, 1e-2, "loss")
    if dtype != torch.float32:  # TF32 rounds logits of ~1e4 by ~5: near-ties move; half inputs are exact
        assert_rel(q.grad, q64.grad, 1e-2, "d image")
        assert_rel(k.grad, k64.grad, 1e-2, "d text")


@pytest.mark.gpu
def test_gpu_infonce_labels_and_nan():
    b, n, d = 3000, 7001, 384
    q = features(b, d, dtype=torch.bfloat16, device="cuda", seed=3)
    k = features(n, d, dtype=torch.bfloat16, device="cuda", seed=4)
    labels = torch.randperm(n, device="cuda")[:b]
    loss = bigbatch.infonce_loss(q, k, 20.0, labels=labels, backend="triton")
    loss.backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref = reference.infonce_loss(q64, k64, 20.0, labels)
    ref.backward()
    assert_rel(loss, ref, 1e-2, "loss")
    assert_rel(q.grad, q64.grad, 1e-2, "dq")
    assert_rel(k.grad, k64.grad, 1e-2, "dk")
    bad = q.detach().clone()
    bad[123, 7] = float("nan")
    assert torch.isnan(bigbatch.clip_loss(bad, k.detach()[:b], 20.0, backend="triton"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_default_super_tiles_with_tails(dtype):
    """The default half-precision super-tile (8192 x 4096) with a tail in both directions and more
    keys than queries: rows 8192 + 1808, key blocks 4096 x 2 + 1809 (InfoNCE with labels), and the
    CLIP loss over the first 10,000 keys."""
    b, n, d = 10000, 10001, 96
    q = features(b, d, dtype=dtype, device="cuda", seed=5)
    k = features(n, d, dtype=dtype, device="cuda", seed=6)
    labels = torch.randperm(n, device="cuda")[:b]
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    for loss_fn, ref_fn in (
        (lambda a, c: bigbatch.infonce_loss(a, c, 30.0, labels=labels), lambda a, c: reference.infonce_loss(a, c, 30.0, labels)),
        (lambda a, c: bigbatch.clip_loss(a, c[:b], 30.0), lambda a, c: reference.clip_loss(a, c[:b], 30.0)),
    ):
        qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
        q64.grad = k64.grad = None
        loss = loss_fn(qq, kk)
        loss.backward()
        ref = ref_fn(q64, k64)
        ref.backward()
        assert_rel(loss, ref, 1e-2, "loss")
        assert_rel(qq.grad, q64.grad, 1e-2, "dq")
        assert_rel(kk.grad, k64.grad, 1e-2, "dk")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,tune",
    [
        (torch.bfloat16, {"col_ref": 0}),
        (torch.bfloat16, {"one_exp": 1, "ds_one_exp": 1}),
        (torch.float32, {"col_ref": 0}),
        (torch.float32, {"one_exp": 1, "ds_one_exp": 1}),
        (torch.float32, {"kmajor": 0}),
        (torch.bfloat16, {"products": "separate"}),
        (torch.bfloat16, {"products": "pair"}),
        (torch.bfloat16, {"products": "cublas"}),
        (torch.float16, {"products": "cublas"}),
        (torch.float32, {"products": "pair"}),
    ],
    ids=str,
)
def test_gpu_variants(dtype, tune):
    b, d = 3001, 512
    q = features(b, d, dtype=dtype, device="cuda", seed=7)
    k = features(b, d, dtype=dtype, device="cuda", seed=8)
    loss = bigbatch.clip_loss(q, k, 1 / 0.07, backend=TritonTiles(tune=tune, super_tile=(1024, 2048)))
    loss.backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ref = reference.clip_loss(q64, k64, 1 / 0.07)
    ref.backward()
    # fp16 features meet the bf16 dS workspace in the products (rounded to bf16 there): half tolerance.
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    assert_rel(loss, ref, tol, "loss")
    assert_rel(q.grad, q64.grad, tol, "d image")
    assert_rel(k.grad, k64.grad, tol, "d text")


@pytest.mark.gpu
def test_gpu_cublas_products_refuse_fp32():
    q = features(64, 32, dtype=torch.float32, device="cuda", seed=1)
    be, s = TritonTiles(tune={"products": "cublas"}), torch.tensor(10.0, device="cuda")
    lr, lc = be.lse(q, q, s, rows=True, cols=True)
    with pytest.raises(ValueError, match="products='cublas' needs float16/bfloat16"):
        be.lse_grad(q, q, s, lr, lc, torch.ones_like(lr), torch.ones_like(lc))


def test_unknown_products_value_is_refused():
    with pytest.raises(ValueError, match=r"tune\['products'\] must be one of"):
        TritonTiles(tune={"products": "magic"})


@pytest.mark.gpu
def test_gpu_auto_picks_triton():
    assert isinstance(resolve_backend("auto", torch.device("cuda")), TritonTiles)


@pytest.mark.parametrize("tune", [{"products": "cublas", "kmajor": 1}, {"kmajor": 1}], ids=str)
def test_kmajor_with_half_inputs(tune):
    """K-major operand copies are converted to the workspace dtype too (fp16 features meet a bf16
    dS workspace on a GPU; cuBLAS refused the mix before)."""
    b, n, d = 29, 33, 12
    q, k = _data(b, n, d, torch.float16, seed=8)
    s = torch.tensor(5.0, device=DEVICE)
    be = TritonTiles(block_m=16, block_n=16, block_d=16, super_tile=(16, 24), tune=tune)
    lr, lc = be.lse(q, k, s, rows=True, cols=True)
    g = torch.Generator().manual_seed(3)
    g_row = torch.rand(b, generator=g).to(DEVICE)
    g_col = torch.rand(n, generator=g).to(DEVICE)
    dq, dk, _ = be.lse_grad(q, k, s, lr, lc, g_row, g_col)
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    logits = 5.0 * q64 @ k64.T
    ref = (torch.logsumexp(logits, 1) * g_row.double()).sum() + (torch.logsumexp(logits, 0) * g_col.double()).sum()
    ref_dq, ref_dk = torch.autograd.grad(ref, (q64, k64))
    assert_rel(dq, ref_dq, 2e-2, "dq")
    assert_rel(dk, ref_dk, 2e-2, "dk")


def test_kernels_launch_with_the_inputs_device_current(monkeypatch):
    """Triton launches on the current CUDA device and its stream: features on cuda:1 in a process
    left on cuda:0 failed ("cannot be accessed from Triton") or, with peer access, ran unordered on
    cuda:0's stream (a review's finding). Every Triton backend entry makes the inputs' device
    current. Simulated: a stand-in tensor on cuda:1 and a recording torch.cuda.device."""
    import types

    from bigbatch.backends.base import on_inputs_device
    from bigbatch.backends.triton_sigmoid import TritonSigmoid
    from bigbatch.backends.triton_softmax import TritonTiles

    from helpers import CudaDeviceRecorder

    devices = CudaDeviceRecorder()
    monkeypatch.setattr(torch.cuda, "device", devices)
    seen = []

    @on_inputs_device
    def launch(self, q, k):
        seen.append(list(devices.current))

    launch(None, types.SimpleNamespace(device=torch.device("cuda", 1)), None)
    launch(None, torch.zeros(1), None)  # a CPU tensor (the interpreter): nothing to switch
    assert seen == [[torch.device("cuda", 1)], []] and devices.current == []
    for method in (TritonTiles.lse, TritonTiles.lse_grad, TritonSigmoid.sigmoid_pass):
        assert getattr(method, "__wrapped__", None) is not None, method


@pytest.mark.parametrize("props, stages", [
    ({"shared_memory_per_block_optin": 232448}, 3),  # H100 / H200
    ({"shared_memory_per_block_optin": 101376}, 2),  # sm_86 / sm_89: 128 KiB does not fit
    ({"major": 8, "minor": 0}, 3),  # a torch without the attribute: by compute capability (A100)
    ({"major": 8, "minor": 9}, 2),
    ({"major": 12, "minor": 0}, 2),  # unknown: the smallest
])
def test_fp32_product_stages_fit_the_devices_shared_memory(monkeypatch, props, stages):
    """The H200-tuned paired fp32 product kernel needs 128 KiB of shared memory in 3 stages: on an
    RTX 30xx / 40xx, A10 or L4 (99 KiB) every fp32 softmax backward raised OutOfResources (a
    review's finding, compiled for those targets on the CPU)."""
    import types

    from bigbatch.backends import triton_softmax

    fake = types.SimpleNamespace(multi_processor_count=100, major=9, minor=0)
    for name, value in props.items():
        setattr(fake, name, value)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: fake)
    cfg = triton_softmax._gpu_config(torch.float32, torch.device("cuda", 0))
    assert cfg.mm_stages == stages
    assert triton_softmax._gpu_config(torch.bfloat16, torch.device("cuda", 0)).products == "cublas"
