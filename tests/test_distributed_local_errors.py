"""Input that is invalid on ONE rank only (caught by the local checks before the ring) raises on
EVERY rank of the group instead of leaving the healthy ranks waiting in the ring's collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import bigbatch

from distributed_harness import run_gloo

# (loss, what rank 1 passes wrongly, expected exception type on rank 1)
CASES = [
    ("clip", "text_dim", ValueError),
    ("clip", "not_a_tensor", TypeError),
    ("clip", "backend", ValueError),
    ("clip", "scale_shape", ValueError),
    ("infonce", "reduction", ValueError),
    ("infonce", "int_features", TypeError),
    # labels are checked with the metadata exchange, not before it: the failing rank still raises
    # its own exception (before: a ValueError wrapping it, whatever its type)
    ("infonce", "labels_list", TypeError),
    ("infonce", "labels_float", TypeError),
    ("infonce", "fewer_keys_than_queries", ValueError),
    # ClipLoss checks its logit_bias before the ring (before: after its forward, so the other
    # ranks waited in the ring's backward until the group's timeout)
    ("ClipLoss", "bias_per_logit", ValueError),
    ("ClipLoss", "bias_string", TypeError),
]


def _call(rank: int, loss: str, bad: str):
    torch.manual_seed(rank)
    q, k = torch.randn(5 + rank, 4), torch.randn(5 + rank, 4)
    scale, kwargs = torch.tensor(3.0), {"group": dist.group.WORLD}
    if rank == 1:
        if bad == "text_dim":
            k = torch.randn(6, 3)
        elif bad == "not_a_tensor":
            k = k.tolist()
        elif bad == "backend":
            kwargs["backend"] = "nope"
        elif bad == "scale_shape":
            scale = torch.ones(2)
        elif bad == "reduction":
            kwargs["reduction"] = "avg"
        elif bad == "int_features":
            q = q.long()
        elif bad == "labels_list":
            kwargs["labels"] = list(range(q.shape[0]))
        elif bad == "labels_float":
            kwargs["labels"] = torch.arange(q.shape[0], dtype=torch.float32)
        elif bad == "fewer_keys_than_queries":
            k = k[:-1]
    if loss == "ClipLoss":
        q.requires_grad_()
        bias = {"bias_per_logit": torch.zeros(3), "bias_string": "high"}[bad] if rank == 1 else torch.tensor(-1.0)
        bigbatch.ClipLoss(group=dist.group.WORLD)(q, k, scale, bias).backward()
        return None
    fn = bigbatch.clip_loss if loss == "clip" else bigbatch.infonce_loss
    return fn(q, k, scale, **kwargs)


def _run_cases(rank: int, world: int):
    out = []
    for loss, bad, _ in CASES:
        try:
            _call(rank, loss, bad)
            out.append(("no error", ""))
        except (TypeError, ValueError) as exc:
            out.append((type(exc).__name__, str(exc)))
        dist.barrier()  # the group is still usable after the error: no rank is stuck
    return out


def test_local_error_on_one_rank_raises_on_every_rank():
    results = run_gloo(_run_cases, 2, timeout=120.0)
    for i, (loss, bad, exc_type) in enumerate(CASES):
        (t0, m0), (t1, m1) = results[0][i], results[1][i]
        assert t1 == exc_type.__name__, f"{loss}/{bad}: rank 1 raised {t1}: {m1}"
        assert t0 == "ValueError", f"{loss}/{bad}: the healthy rank got {t0}"
        assert "rank(s) [1]" in m0 and m1.split(" got")[0][:20] in m0, f"{loss}/{bad}: {m0!r} vs {m1!r}"


def _double_backward(rank: int, world: int):
    out = []
    # (the gather path, backend="reference", too: its all_reduce has no derivative, and the
    # second-order terms through it were silently missing)
    for loss, backend in (("clip", "auto"), ("infonce", "auto"), ("siglip", "auto"), ("clip", "reference"),
                          ("infonce", "reference")):
        torch.manual_seed(rank)
        q = torch.randn(4 + rank, 3, requires_grad=True)
        k = torch.randn(4 + rank, 3, requires_grad=True)
        if loss == "siglip":
            value = bigbatch.siglip_loss(q, k, 2.0, -1.0, group=dist.group.WORLD, backend=backend)
        else:
            value = (bigbatch.clip_loss if loss == "clip" else bigbatch.infonce_loss)(
                q, k, 2.0, group=dist.group.WORLD, backend=backend)
        try:
            torch.autograd.grad(value, q, create_graph=True)
            out.append("no error")
        except RuntimeError as exc:
            out.append(str(exc))
        dist.barrier()  # nobody is left inside the ring's collectives
    return out


def test_double_backward_through_the_ring_is_a_clear_error_on_every_rank():
    for per_rank in run_gloo(_double_backward, 2, timeout=120.0):
        assert all("first-order gradients only" in msg for msg in per_rank), per_rank


def _siglip_backends_differ(rank: int, world: int):
    from bigbatch.backends.torch_sigmoid import TorchSigmoid

    torch.manual_seed(rank)
    q, k = torch.randn(64, 4), torch.randn(64, 4)
    backend = TorchSigmoid(workspace_bytes=4096) if rank == 0 else TorchSigmoid()
    try:
        bigbatch.siglip_loss(q, k, 2.0, -1.0, group=dist.group.WORLD, backend=backend)
        return "no error"
    except ValueError as exc:
        return str(exc)


def test_siglip_ring_backends_configured_differently_raise_on_every_rank():
    """The sigmoid ring's chunking follows the backend's workspace rule: ranks configured
    differently would exchange messages of different sizes (gloo aborted every process)."""
    for msg in run_gloo(_siglip_backends_differ, 2, timeout=120.0):
        assert "the backend's type and settings (e.g. workspace_bytes) must be the same on every rank" in msg, msg


def test_group_backend_and_feature_device_must_match():
    """gloo's send/recv (the ring) move only CPU tensors and NCCL only CUDA tensors: a mismatch is a
    clear error (found before any transfer); gloo's gather path (backend='reference') still takes
    CUDA features."""
    from bigbatch.distributed.ring import _group_problem

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    problem = _group_problem("gloo", cuda, True)
    assert "backend is gloo" in problem and "NCCL group" in problem
    assert _group_problem("gloo", cuda, False) is None and _group_problem("gloo", cpu, True) is None
    assert "backend is nccl" in _group_problem("nccl", cpu, False)
    for backend, dev in (("nccl", "cuda"), ("undefined", "cuda"), ("undefined", "cpu")):
        assert _group_problem(backend, torch.device(dev), True) is None


@pytest.mark.parametrize("backend,config,want", [
    ("gloo", "cpu:gloo,cuda:gloo", "cpu"),
    # init_process_group() without a backend on a GPU machine: gloo and NCCL in one group. A rank
    # whose input is not a tensor used the CPU (gloo), the others their CUDA features (NCCL): a hang
    ("undefined", "cpu:gloo,cuda:nccl", "cpu"),
    ("mpi", "cpu:mpi,cuda:mpi", "cpu"),
    ("nccl", "cuda:nccl", "cuda:1"),
    ("xccl", "xpu:xccl", "xpu"),
])
def test_metadata_exchange_device_follows_the_group_not_the_features(monkeypatch, backend, config, want):
    from bigbatch.distributed import ring

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for features in (torch.device("cpu"), torch.device("cuda", 1), None):
        got = ring.exchange_device(None, features)
        if want == "xpu":  # another accelerator: the features' device when of its type, else its default
            assert got == torch.device("xpu")
        else:
            assert got == torch.device(want), (features, got)
    assert ring.exchange_device(None, torch.device("xpu", 2)) == (torch.device("xpu", 2) if want == "xpu" else torch.device(want))


def _gloo_cuda_features(rank: int, world: int):
    out = []
    for loss in ("clip", "infonce", "siglip"):
        for backend in ("auto",) if loss == "siglip" else ("auto", "reference"):  # (siglip: no reference ring)
            torch.manual_seed(rank)
            q, k = torch.randn(4 + rank, 3, device="cuda"), torch.randn(4 + rank, 3, device="cuda")
            try:
                if loss == "siglip":
                    value = bigbatch.siglip_loss(q, k, 2.0, -1.0, group=dist.group.WORLD, backend=backend)
                else:
                    value = (bigbatch.clip_loss if loss == "clip" else bigbatch.infonce_loss)(
                        q, k, 2.0, group=dist.group.WORLD, backend=backend)
                out.append((backend, f"value {value.item():.6f}"))
            except ValueError as exc:
                out.append((backend, str(exc)))
            dist.barrier()
    return out


@pytest.mark.gpu
def test_cuda_features_on_a_gloo_group():
    """The ring (send/recv) refuses them on every rank; the gather path works."""
    per_rank = run_gloo(_gloo_cuda_features, 2, timeout=120.0)
    for rank_out in per_rank:
        for backend, msg in rank_out:
            if backend == "auto":
                assert "backend is gloo" in msg, msg
            else:
                assert msg.startswith("value "), msg
    assert [m for _, m in per_rank[0]] == [m for _, m in per_rank[1]]  # the same value on both ranks


def _grad_chunk_cases(rank: int, world: int):
    from bigbatch.backends import resolve_backend
    from bigbatch.distributed import ring_clip_loss, ring_infonce_loss
    from bigbatch.distributed.softmax import grad_chunk_rows

    torch.manual_seed(rank)
    q = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    backend = resolve_backend("torch", q.device, q.dtype)
    out = []
    for fn in (ring_clip_loss, ring_infonce_loss):
        # different, invalid on rank 1, and the default given explicitly on one rank only (equivalent)
        for chunks in ((2, 3), (2, 0), (None, grad_chunk_rows(3))):
            try:
                fn(q, k, torch.tensor(5.0, dtype=torch.float64), group=dist.group.WORLD, backend=backend,
                   grad_chunk=chunks[rank]).backward()
                out.append("no error")
            except ValueError as exc:
                out.append(str(exc))
            dist.barrier()
    return out


def test_grad_chunk_is_checked_and_agreed_on_every_rank():
    """The softmax ring's backward cuts its messages by grad_chunk: different values across ranks
    made gloo abort the processes (messages of different sizes), and an invalid value on one rank
    raised there only (after the exchange) while the other waited in the ring."""
    for out in run_gloo(_grad_chunk_cases, 2, timeout=120.0):
        for differ, invalid, default in (out[0:3], out[3:6]):
            assert "grad_chunk must be the same on every rank" in differ, differ
            assert "rank(s) [1]" in invalid and "grad_chunk must be a positive int" in invalid, invalid
            assert default == "no error", default


def _dual_on_one_rank(rank: int, world: int):
    from torch.autograd import forward_ad as fwAD

    torch.manual_seed(rank)
    q, k = torch.randn(4, 3), torch.randn(4, 3)
    group, out = dist.group.WORLD, []
    for name, loss in (("clip", lambda x: bigbatch.clip_loss(x, k, 2.0, group=group, backend="torch")),
                       ("infonce", lambda x: bigbatch.infonce_loss(x, k, 2.0, group=group, backend="torch")),
                       ("clip_reference", lambda x: bigbatch.clip_loss(x, k, 2.0, group=group, backend="reference")),
                       ("siglip", lambda x: bigbatch.siglip_loss(x, k, 2.0, -1.0, group=group, backend="torch"))):
        try:
            if rank == 0:
                with fwAD.dual_level():
                    loss(fwAD.make_dual(q, torch.ones_like(q)))
            else:
                loss(q.clone().requires_grad_()).backward()
            out.append((name, "no error"))
        except (NotImplementedError, ValueError) as exc:
            out.append((name, f"{type(exc).__name__}: {exc}"))
        dist.barrier()  # nobody is still inside the loss
    return out


def test_forward_ad_on_one_rank_raises_on_every_rank():
    """A dual tensor on one rank (the others training): refused before the ring's collectives,
    on every rank (before: the refusal came from inside the autograd Function on that rank only,
    after the forward's collectives, and the other ranks waited in the next one: a hang)."""
    results = run_gloo(_dual_on_one_rank, 2, timeout=120.0)
    for (name, r0), (_, r1) in zip(results[0], results[1]):
        assert "forward-mode AD" in r0, f"{name}: rank 0 got {r0}"
        assert r1.startswith("ValueError") and "rank(s) [0]" in r1, f"{name}: rank 1 got {r1}"


def _direct_entry_points(rank: int, world: int):
    from bigbatch.distributed import ring_clip_loss, ring_infonce_loss

    torch.manual_seed(rank)
    q = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    out = []
    cases = [
        lambda: ring_clip_loss(q, k, 5.0, group=dist.group.WORLD, backend="bogus"),
        lambda: ring_infonce_loss(q, k, 5.0, reduction="avg" if rank == 1 else "mean", group=dist.group.WORLD),
        lambda: ring_clip_loss(q, k, "5", group=dist.group.WORLD),
    ]
    for case in cases:
        try:
            case()
            out.append("no error")
        except (ValueError, TypeError) as exc:
            out.append(str(exc))
        dist.barrier()
    # a python float scale and a backend name are what bigbatch.clip_loss takes: the same loss
    loss = ring_clip_loss(q, k, 5.0, group=dist.group.WORLD, backend="torch")
    ref = bigbatch.clip_loss(q, k, 5.0, group=dist.group.WORLD, backend="torch")
    out.append(abs(loss.item() - ref.item()))
    return out


def test_the_exported_ring_entry_points_check_their_inputs_on_every_rank():
    """bigbatch.distributed.ring_clip_loss / ring_infonce_loss ran any backend string as the gather
    path, raised a bare KeyError for a bad reduction (on that rank only) and an AttributeError for a
    float scale (session 12): they now check as clip_loss(group=...) does."""
    for out in run_gloo(_direct_entry_points, 2, timeout=120.0):
        bad_backend, bad_reduction, bad_scale, diff = out
        assert "backend" in bad_backend and "bogus" in bad_backend, bad_backend
        assert "reduction" in bad_reduction and "avg" in bad_reduction, bad_reduction
        assert "scale" in bad_scale, bad_scale
        assert diff < 1e-12


def _ring_of_one_checks(rank: int, world: int):
    from bigbatch.distributed import Ring, gather_with_grad, offsets

    ring = Ring.of(dist.group.WORLD)
    out = []
    for case in (lambda: ring.shift([torch.ones(1, 3)], [torch.empty(4, 3)]),
                 lambda: ring.shift([torch.tensor([1.7])], [torch.empty(1, dtype=torch.long)]),
                 lambda: gather_with_grad(torch.ones(2, 3), ring, [5]),
                 lambda: offsets([2, -3])):
        try:
            case()
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_the_exported_ring_primitives_refuse_what_a_real_ring_would():
    """On a ring of one, shift broadcast and cast into a mismatched buffer and gather_with_grad
    ignored a wrong sizes list (a real ring fails there); offsets took negative sizes (session 12)."""
    shape, dtype, sizes, negative = run_gloo(_ring_of_one_checks, 1, timeout=120.0)[0]
    assert "shape and dtype of send[0]" in shape and "shape and dtype of send[0]" in dtype
    assert "sizes[0] must list every rank's rows" in sizes
    assert "must be >= 0" in negative


@pytest.mark.parametrize("name,local", [("ring_clip_loss", "clip_loss"), ("ring_infonce_loss", "infonce_loss"),
                                        ("ring_siglip_loss", "siglip_loss")])
def test_direct_ring_api_without_a_group_names_the_single_process_loss(name, local):
    """bigbatch.distributed.ring_*_loss(group=None): one clear message for all three (the sigmoid
    ring reached torch's "Group None is not registered", or with no process group initialised a
    message about a group that was not given)."""
    import bigbatch.distributed as bd

    args = (torch.randn(4, 3), torch.randn(4, 3), 2.0) + ((-1.0,) if local == "siglip_loss" else ())
    with pytest.raises(ValueError, match=rf"{name} needs a process group \(group=...\); without one use bigbatch.{local}"):
        getattr(bd, name)(*args, group=None)


def _error_exchange_devices(rank: int, world: int):
    """The devices the error path's object gathers were made current on (recorded)."""
    from bigbatch.distributed import ring

    seen, original = [], ring.cuda_device_current

    def recording(device):
        seen.append(str(device))
        return original(device)

    ring.cuda_device_current = recording
    k = torch.randn(5, 4 if rank == 0 else 3)  # rank 1: another feature width
    try:
        bigbatch.clip_loss(torch.randn(5, 4), k, 3.0, group=dist.group.WORLD)
    except ValueError:
        pass
    return seen


def test_error_exchanges_run_on_the_features_device(monkeypatch):
    """torch packs an object all_gather on the current CUDA device and NCCL keys communicators by
    device: a rank whose features are on cuda:1 in a process whose current device is cuda:0 must
    exchange its error there, not on cuda:0 (a hang; a review's finding). Simulated: which device
    ``cuda_device_current`` makes current, and that the error path goes through it (gloo: the CPU)."""
    from bigbatch.backends.base import cuda_device_current

    from helpers import CudaDeviceRecorder

    assert run_gloo(_error_exchange_devices, 2, timeout=120.0) == [["cpu"], ["cpu"]]
    devices = CudaDeviceRecorder()
    monkeypatch.setattr(torch.cuda, "device", devices)
    with cuda_device_current(torch.device("cuda", 1)):
        pass
    with cuda_device_current(torch.device("cpu")):
        pass
    assert devices.entered == [torch.device("cuda", 1)]
