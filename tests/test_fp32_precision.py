"""float32 dot precision of the fused kernels: by default what a float32 ``torch.mm`` on CUDA would
use at the time of the call (exact fp32 unless the caller allowed TF32), or what the backend asks.

The resolver is checked on the CPU against each of torch's ways to allow TF32 (each restored
through the API that set it: torch refuses a legacy read after a mix of its two APIs); the GPU
tests check the numbers: the default is exact-fp32 accurate, TF32 only when allowed.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import pytest
import torch

import bigbatch
from bigbatch import reference
from bigbatch.backends.gemm import FP32_PRECISIONS, fp32_dot_precision, torch_allows_tf32

from helpers import assert_rel, features

MM = torch.backends.cuda.matmul
NEW_API = hasattr(MM, "fp32_precision")


@contextlib.contextmanager
def matmul_setting(how: str) -> Iterator[None]:
    """Allow TF32 for CUDA float32 matmuls one way, and put it back the same way."""
    if how == "legacy_flag":
        old = MM.allow_tf32
        MM.allow_tf32 = True
        try:
            yield
        finally:
            MM.allow_tf32 = old
    elif how in ("high", "medium"):
        old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(how)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(old)
    elif how == "cuda_matmul":
        old = MM.fp32_precision
        MM.fp32_precision = "tf32"
        try:
            yield
        finally:
            MM.fp32_precision = old
    elif how == "global":  # inherited by CUDA matmuls unless they have their own value
        old, old_mm = torch.backends.fp32_precision, MM.fp32_precision
        torch.backends.fp32_precision, MM.fp32_precision = "tf32", "none"
        try:
            yield
        finally:
            torch.backends.fp32_precision, MM.fp32_precision = old, old_mm
    else:
        raise AssertionError(how)


WAYS = ["legacy_flag", "high", "medium"] + (["cuda_matmul", "global"] if NEW_API else [])


def test_default_is_exact_fp32_as_torch_mm():
    assert not torch_allows_tf32()
    assert fp32_dot_precision(None) == "ieee"


@pytest.mark.parametrize("how", WAYS)
def test_default_follows_each_way_torch_allows_tf32(how):
    with matmul_setting(how):
        assert torch_allows_tf32()
        assert fp32_dot_precision(None) == "tf32"
        assert fp32_dot_precision("ieee") == "ieee"  # an explicit choice wins
    assert fp32_dot_precision(None) == "ieee"  # read at each call, not cached
    assert fp32_dot_precision("tf32") == "tf32"


@pytest.mark.skipif(not NEW_API, reason="torch without the fp32_precision API")
def test_cuda_matmul_ieee_overrides_a_global_tf32():
    with matmul_setting("global"):
        old = MM.fp32_precision
        MM.fp32_precision = "ieee"
        try:
            assert fp32_dot_precision(None) == "ieee"
        finally:
            MM.fp32_precision = old


def test_backends_check_the_precision_argument():
    pytest.importorskip("triton")
    from bigbatch.backends.triton_sigmoid import TritonSigmoid
    from bigbatch.backends.triton_softmax import TritonTiles

    assert TritonTiles().precision is None and TritonSigmoid().fp32_precision is None
    for p in FP32_PRECISIONS:
        TritonTiles(precision=p), TritonSigmoid(fp32_precision=p)
    with pytest.raises(ValueError, match=r"TritonTiles: precision must be one of \('tf32', 'ieee'\) or None"):
        TritonTiles(precision="highest")
    with pytest.raises(ValueError, match="TritonSigmoid: fp32_precision must be one of"):
        TritonSigmoid(fp32_precision="TF32")


# ----------------------------------------------------------------------------- real GPU tests
def _clip_case(b: int, d: int):
    q = features(b, d, dtype=torch.float32, device="cuda", seed=b)
    k = features(b, d, dtype=torch.float32, device="cuda", seed=b + 1)
    logit = torch.tensor(math.log(100.0), device="cuda", requires_grad=True)
    q.requires_grad_(), k.requires_grad_()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    l64 = logit.detach().double().requires_grad_()
    ref = reference.clip_loss(q64, k64, l64.exp())
    ref.backward()
    return (q, k, logit), (ref, q64.grad, k64.grad, l64.grad)


def _errors(loss_fn, inputs, truth) -> list:
    q, k, logit = inputs
    q.grad = k.grad = logit.grad = None
    loss = loss_fn(q, k, logit.exp())
    loss.backward()
    got = (loss, q.grad, k.grad, logit.grad)
    return [((g.double() - t).norm() / t.norm()).item() for g, t in zip(got, truth)]


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_gpu_default_fp32_is_exact_and_tf32_only_when_allowed(loss):
    """At scale 100, TF32 products put ~1e-3 relative error on the gradients: the default must not
    (torch's default is full fp32), and must once the caller allows TF32 (the speed they asked for)."""
    if loss == "clip":
        fn = bigbatch.clip_loss
        inputs, truth = _clip_case(3000, 768)
    else:
        def fn(q, k, s):
            return bigbatch.siglip_loss(q, k, s, -10.0)
        q, k, logit = _clip_case(3000, 768)[0]
        q64, k64, l64 = (x.detach().double().requires_grad_() for x in (q, k, logit))
        ref = reference.siglip_loss(q64, k64, l64.exp(), -10.0)
        ref.backward()
        inputs, truth = (q, k, logit), (ref, q64.grad, k64.grad, l64.grad)
    exact = _errors(fn, inputs, truth)
    assert max(exact) < 1e-5, exact
    for how in WAYS:
        with matmul_setting(how):
            fast = _errors(fn, inputs, truth)
        assert max(fast) < 5e-3, (how, fast)
        if loss == "clip":  # the softmax kernels' TF32 dots are visible at this scale
            assert max(fast) > 1e-5, (how, fast)
    assert _errors(fn, inputs, truth) == exact  # the setting was put back, and the kernels follow it


@pytest.mark.gpu
def test_gpu_explicit_precision_ignores_the_global_setting():
    from bigbatch.backends.triton_softmax import TritonTiles

    inputs, truth = _clip_case(2000, 512)
    with matmul_setting("high"):
        exact = _errors(lambda q, k, s: bigbatch.clip_loss(q, k, s, backend=TritonTiles(precision="ieee")), inputs, truth)
    assert max(exact) < 1e-5, exact
    fast = _errors(lambda q, k, s: bigbatch.clip_loss(q, k, s, backend=TritonTiles(precision="tf32")), inputs, truth)
    assert 1e-5 < max(fast) < 5e-3, fast


@pytest.mark.skipif(not NEW_API, reason="torch without the fp32_precision API")
def test_a_block_at_the_precision_in_force_pins_nothing():
    """fp32_matmul (the sigmoid kernels' cuBLAS products) at the precision already in force touches
    nothing: restoring the CUDA matmul's read value pinned one inherited from the global setting,
    so that a later change of torch.backends.fp32_precision no longer reached torch.mm."""
    from bigbatch.backends.gemm import fp32_matmul

    with matmul_setting("global"):
        with fp32_matmul(fp32_dot_precision(None)):
            assert torch_allows_tf32()
        torch.backends.fp32_precision = "ieee"
        assert MM.fp32_precision == "ieee" and not torch_allows_tf32()
    with fp32_matmul("tf32"):  # an explicit other precision is set for the block and put back
        assert torch_allows_tf32()
    assert not torch_allows_tf32()


@pytest.mark.skipif(not NEW_API, reason="torch without the fp32_precision API")
def test_a_block_at_another_precision_leaves_the_inherited_setting_inherited():
    """fp32_matmul("ieee") under a global "tf32" setting: putting back the CUDA matmul's read value
    pinned it (it reads the value it inherits), so a later global "ieee" no longer reached torch.mm
    (a review's finding)."""
    from bigbatch.backends.gemm import fp32_matmul

    with matmul_setting("global"):  # torch.backends.fp32_precision = "tf32", the matmul's own unset
        with fp32_matmul("ieee"):
            assert not torch_allows_tf32()
        assert torch_allows_tf32()
        torch.backends.fp32_precision = "ieee"
        assert MM.fp32_precision == "ieee" and not torch_allows_tf32()


def test_reading_the_setting_warns_nothing():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for how in WAYS:
            with matmul_setting(how):
                assert fp32_dot_precision(None) == "tf32"
        assert fp32_dot_precision(None) == "ieee"
