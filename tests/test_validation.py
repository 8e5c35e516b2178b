"""Bad inputs get ValueError/TypeError naming the argument and the expectation (DESIGN.md §2a)."""

from __future__ import annotations

import pytest
import torch

import bigbatch
from bigbatch.backends import TorchTiles


def ok(b=8, d=4, dtype=torch.float32):
    return torch.randn(b, d, dtype=dtype)


CLIP_CASES = [
    # (image, text, scale, kwargs, error, message fragment)
    ([[1.0]], ok(), 1.0, {}, TypeError, "image_features must be a torch.Tensor"),
    (ok(), "text", 1.0, {}, TypeError, "text_features must be a torch.Tensor"),
    (torch.randn(8), ok(), 1.0, {}, ValueError, "image_features must be 2-D"),
    (ok(), torch.randn(2, 8, 4), 1.0, {}, ValueError, "text_features must be 2-D"),
    (ok(0), ok(0), 1.0, {}, ValueError, "at least one row"),
    (ok(8, 0), ok(8, 0), 1.0, {}, ValueError, "at least one feature column"),
    (ok(8, 4), ok(8, 5), 1.0, {}, ValueError, "same feature dimension"),
    (ok(8, 4), ok(9, 4), 1.0, {}, ValueError, "same batch size"),
    (ok().int(), ok().int(), 1.0, {}, TypeError, "floating dtype"),
    (ok(dtype=torch.float16), ok(), 1.0, {}, TypeError, "same dtype"),
    (ok(), ok(), "big", {}, TypeError, "scale must be a float or a 0-d floating tensor"),
    (ok(), ok(), torch.ones(3), {}, ValueError, "scale must be a scalar"),
    (ok(), ok(), torch.tensor(True), {}, TypeError, "scale must be a real floating"),
    (ok(), ok(), torch.tensor(2j), {}, TypeError, "scale must be a real floating"),
    (ok(), ok(), float("inf"), {}, ValueError, "scale must be finite"),
    (ok(), ok(), 10**400, {}, ValueError, "scale must be finite in float64"),
    (ok(), ok(), 1e39, {}, ValueError, "scale must be finite in the loss's compute dtype torch.float32"),
    (ok(), ok(), 10**39, {}, ValueError, "scale must be finite in the loss's compute dtype"),
    (ok().to_sparse(), ok(), 1.0, {}, TypeError, "image_features must be a dense"),
    (ok(), ok().to_sparse_csr(), 1.0, {}, TypeError, "text_features must be a dense"),
    (ok(), ok(), True, {}, TypeError, "scale must be a float"),
    (ok(), ok(), 1.0, {"backend": "cuda-magic"}, ValueError, "backend must be one of"),
    (ok(), ok(), 1.0, {"backend": 3}, TypeError, "backend must be one of"),
    (ok(), ok(), 1.0, {"group": "world"}, ValueError, "torch.distributed is not initialised"),
]


@pytest.mark.parametrize("image,text,scale,kwargs,error,fragment", CLIP_CASES)
def test_clip_bad_inputs(image, text, scale, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        bigbatch.clip_loss(image, text, scale, **kwargs)


INFONCE_CASES = [
    (ok(8), ok(5), {}, ValueError, "keys needs at least as many rows as queries"),
    (ok(8), ok(10), {"labels": torch.zeros(8)}, TypeError, "labels must have an integer dtype"),
    (ok(8), ok(10), {"labels": torch.zeros(8, dtype=torch.bool)}, TypeError, "labels must have an integer dtype"),
    (ok(8), ok(10), {"labels": [0] * 8}, TypeError, "labels must be a torch.Tensor"),
    (ok(8), ok(10), {"labels": torch.zeros(7, dtype=torch.long)}, ValueError, r"labels must have shape \(8,\)"),
    (ok(8), ok(10), {"labels": torch.zeros(8, 1, dtype=torch.long)}, ValueError, r"labels must have shape \(8,\)"),
    (ok(8), ok(10), {"labels": torch.full((8,), 10)}, ValueError, r"labels must index keys in \[0, 10\)"),
    (ok(8), ok(10), {"labels": torch.full((8,), -1)}, ValueError, r"labels must index keys in \[0, 10\)"),
    (ok(8), ok(10), {"reduction": "avg"}, ValueError, "reduction must be one of"),
]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("q,k,kwargs,error,fragment", INFONCE_CASES)
def test_infonce_bad_inputs(backend, q, k, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        bigbatch.infonce_loss(q, k, 1.0, backend=backend, **kwargs)


def test_meta_device_mismatch_is_rejected():
    with pytest.raises(ValueError, match="same device"):
        bigbatch.clip_loss(ok(), torch.randn(8, 4, device="meta"), 1.0)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    """Refused before the kernel modules are imported: Triton fixes at ``@triton.jit`` time whether
    a kernel is interpreted, so an import here would break later interpreted runs in the process."""
    import sys

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    modules = ("bigbatch.backends.triton_softmax", "bigbatch.backends.triton_sigmoid")
    before = [m in sys.modules for m in modules]
    with pytest.raises(ValueError, match="triton"):
        bigbatch.clip_loss(ok(), ok(), 1.0, backend="triton")
    with pytest.raises(ValueError, match="triton"):
        bigbatch.siglip_loss(ok(), ok(), 1.0, 0.0, backend="triton")
    assert [m in sys.modules for m in modules] == before


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_tile_sizes_validated(bad):
    with pytest.raises(ValueError, match="tile_rows must be a positive int"):
        TorchTiles(tile_rows=bad)


def test_cpu_scalar_scale_tensor_is_accepted():
    """A 0-d CPU tensor is a scalar to torch; it is accepted (and differentiated) like one."""
    s = torch.tensor(3.0, requires_grad=True)
    bigbatch.clip_loss(ok(), ok(), s).backward()
    assert s.grad is not None and torch.isfinite(s.grad)


def test_auto_keeps_float64_on_torch_tiles_on_cuda():
    """The fused kernels take half/single precision; "auto" must not hand them float64."""
    from bigbatch.backends import resolve_backend, triton_available

    cuda = torch.device("cuda")
    assert isinstance(resolve_backend("auto", cuda, torch.float64), TorchTiles)
    if triton_available():
        assert resolve_backend("auto", cuda, torch.bfloat16).name == "triton"


@pytest.mark.parametrize("bad", ["bias_overflow", "sparse"])
def test_siglip_bad_inputs(bad):
    q, k = ok(), ok()
    bias, fragment = 0.0, "bias must be finite in the loss's compute dtype"
    if bad == "bias_overflow":
        bias = -1e39
    else:
        q, fragment = q.to_sparse(), "image_features must be a dense"
    with pytest.raises((ValueError, TypeError), match=fragment):
        bigbatch.siglip_loss(q, k, 2.0, bias)


@pytest.mark.parametrize("block", [(24, 32, 32, 4, 1), (32.0, 32, 32, 4, 1), ("a", 32, 32, 4, 1), 5,
                                   [24, 32, 32, 4, 1], (32, 32, 32, 3, 1), (32, 32, 32, 4, 0)])
def test_triton_sigmoid_block_is_checked_at_construction(block):
    pytest.importorskip("triton")
    from bigbatch.backends.triton_sigmoid import TritonSigmoid

    with pytest.raises(ValueError, match="TritonSigmoid: block must be a tuple"):
        TritonSigmoid(block=block)
    with pytest.raises(TypeError, match="fast_math must be a bool"):
        TritonSigmoid(fast_math="no")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_labels(dtype):
    q, k = torch.randn(5, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    labels = torch.tensor([6, 5, 4, 3, 2])
    want = bigbatch.infonce_loss(q, k, 2.0, labels=labels)
    assert torch.equal(bigbatch.infonce_loss(q, k, 2.0, labels=labels.to(dtype)), want)
    with pytest.raises(ValueError, match=r"labels must index keys in \[0, 7\)"):
        bigbatch.infonce_loss(q, k, 2.0, labels=torch.tensor([9, 0, 0, 0, 0]).to(dtype))


def test_uint64_labels_of_2_to_the_63_or_more_are_reported_as_given():
    """They wrapped to negative in the int64 the reductions take: the error read [-1, 2]."""
    q, k = torch.randn(4, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    big = torch.tensor([0, 1, 2, 2**64 - 1], dtype=torch.uint64)
    with pytest.raises(ValueError, match=r"got values in \[0, 18446744073709551615\]"):
        bigbatch.infonce_loss(q, k, 2.0, labels=big)


def test_triton_sigmoid_block_given_as_a_list():
    pytest.importorskip("triton")
    from bigbatch.backends.triton_sigmoid import TritonSigmoid

    assert TritonSigmoid(block=[32, 32, 32, 4, 1]).block == (32, 32, 32, 4, 1)


def test_backend_class_instead_of_instance_is_a_clear_error():
    from bigbatch.backends import TorchSigmoid

    with pytest.raises(TypeError, match=r"got the class TorchTiles: pass an instance, e.g. backend=TorchTiles\(\)"):
        bigbatch.clip_loss(ok(), ok(), 1.0, backend=TorchTiles)
    with pytest.raises(TypeError, match=r"backend=TorchSigmoid\(\)"):
        bigbatch.siglip_loss(ok(), ok(), 1.0, 0.0, backend=TorchSigmoid)


def test_numpy_zero_d_scale_is_a_number():
    np = pytest.importorskip("numpy")
    q, k = ok(), ok()
    want = bigbatch.clip_loss(q, k, 2.5)
    assert torch.equal(bigbatch.clip_loss(q, k, np.array(2.5)), want)
    assert torch.equal(bigbatch.clip_loss(q, k, np.float32(2.5)), want)
    assert torch.equal(bigbatch.siglip_loss(q, k, np.array(2), np.array(-1.0)), bigbatch.siglip_loss(q, k, 2.0, -1.0))
    with pytest.raises(TypeError, match="scale must be a float"):
        bigbatch.clip_loss(q, k, np.array([2.5, 1.0]))


@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (1, 1, 1)])
def test_one_element_scale_and_bias_of_any_shape(shape):
    """The error said "0-d or 1-element tensor" and refused a (1, 1) one, which ClipLoss's bias took
    (session 12): every one-element shape is the same number."""
    torch.manual_seed(0)
    q, k = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    s, b = torch.full(shape, 3.0, dtype=torch.float64), torch.full(shape, -1.0, dtype=torch.float64)
    assert bigbatch.clip_loss(q, k, s).item() == pytest.approx(bigbatch.clip_loss(q, k, 3.0).item(), rel=1e-12)
    assert bigbatch.siglip_loss(q, k, s, b).item() == pytest.approx(bigbatch.siglip_loss(q, k, 3.0, -1.0).item(), rel=1e-12)
    assert bigbatch.SigLipLoss()(q, k, s, b).item() == pytest.approx(bigbatch.siglip_loss(q, k, 3.0, -1.0).item(), rel=1e-12)


def test_reference_infonce_refuses_an_unknown_reduction():
    """Any other name fell through to the per-row losses (session 12)."""
    from bigbatch import reference

    q = torch.randn(4, 3)
    with pytest.raises(ValueError, match="reduction must be one of"):
        reference.infonce_loss(q, q, 2.0, reduction="avg")


def test_documented_import_paths_exist():
    """The README's `TritonTiles(precision=...)` / `TritonSigmoid(...)` next to `from bigbatch.backends
    import TorchTiles`, and docs/siglip.md's `ring_siglip_loss`, were ImportErrors at those paths."""
    from bigbatch.backends import TritonSigmoid, TritonTiles  # noqa: F401 (needs triton: a test dependency)
    from bigbatch.distributed import ring_siglip_loss  # noqa: F401
    import bigbatch.backends

    with pytest.raises(AttributeError, match="no attribute 'TritonNope'"):
        bigbatch.backends.TritonNope


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_integer_tensor_scale_and_bias_are_promoted_as_openclip_does(backend):
    """OpenCLIP's modules take ``torch.tensor(10)`` as logit_scale / logit_bias (torch promotes it):
    the drop-ins give the float value's loss (they refused it with a TypeError before)."""
    img, txt = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    for scale in (torch.tensor(10), torch.tensor([3], dtype=torch.int32)):
        f = float(scale)
        assert bigbatch.clip_loss(img, txt, scale, backend=backend) == bigbatch.clip_loss(img, txt, f, backend=backend)
        assert bigbatch.ClipLoss(backend=backend)(img, txt, scale, torch.tensor(-3)) == bigbatch.clip_loss(img, txt, f, backend=backend)
        want = bigbatch.siglip_loss(img, txt, f, -3.0, backend=backend)
        assert bigbatch.siglip_loss(img, txt, scale, torch.tensor(-3), backend=backend) == want
        assert bigbatch.SigLipLoss(backend=backend)(img, txt, scale, torch.tensor(-3)) == want


def test_backend_name_is_not_a_setting():
    """`name` was a constructor field placed before `workspace_bytes`: TorchSigmoid(None, None, 1 << 20)
    stored 1 << 20 as the name and kept the default workspace, silently."""
    from bigbatch.backends import TorchSigmoid

    assert TorchSigmoid(None, None, 1 << 20).workspace_bytes == 1 << 20
    assert TorchTiles().name == "torch" and TorchSigmoid().name == "torch"
    for cls in (TorchTiles, TorchSigmoid):
        with pytest.raises(TypeError):
            cls(name="other")


def test_openclip_rank_and_world_size_may_be_numpy_ints():
    np = pytest.importorskip("numpy")
    img, txt = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    want = bigbatch.clip_loss(img, txt, 2.0)
    assert bigbatch.ClipLoss(rank=np.int64(0), world_size=np.int64(1))(img, txt, 2.0) == want
    with pytest.raises(ValueError, match="rank must be a non-negative int"):
        bigbatch.ClipLoss(rank=np.int64(-1), world_size=1)
