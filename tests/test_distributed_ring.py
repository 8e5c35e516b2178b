"""The ring across real gloo processes: exact loss and gradients vs one process, errors on every rank.

Each test spawns its processes once and runs many checks inside (a spawn costs seconds).
Truth: ``bigbatch.reference`` in float64 on the whole global batch, computed on every rank.
A small shared encoder (one Linear per modality, same weights on every rank) turns inputs
into features; parameter gradients are averaged over ranks as DDP does, and must equal the
single-process gradients; the mean over ranks of the returned loss must equal the global loss.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from distributed_harness import run_gloo

# gloo moves CPU tensors, so the gloo rings run the Triton backend under the interpreter, which only
# CPU-only machines use (a GPU machine tests it on the NCCL ring below; its Triton may lack a working
# interpreter, as 3.6's with numpy 2 does).
HAS_TRITON_BACKEND = (
    importlib.util.find_spec("triton") is not None
    and importlib.util.find_spec("bigbatch.backends.triton_softmax") is not None
    and not torch.cuda.is_available()
)


def _rel(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)


def _backend(name):
    from bigbatch.backends import TorchTiles

    if name == "torch_small_tiles":  # tails that don't divide the tiles
        return TorchTiles(tile_rows=3, tile_cols=5)
    return name


class _Encoders(torch.nn.Module):
    """Two Linear towers + CLIP's logit_scale, identical on every rank (seeded)."""

    def __init__(self, din, d, dtype, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.img = torch.nn.Parameter(torch.randn(din, d, generator=g, dtype=torch.float64).to(dtype) / din**0.5)
        self.txt = torch.nn.Parameter(torch.randn(din, d, generator=g, dtype=torch.float64).to(dtype) / din**0.5)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64).to(dtype))

    def forward(self, x_img, x_txt):
        return x_img @ self.img, x_txt @ self.txt, self.logit_scale.exp()


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _ddp_average(model, world, group=None):
    out = []
    for p in model.parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=group)
        out.append(g / world)
    return out


def _data(sizes, din, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + 1)
    total = sum(sizes)
    return (torch.randn(total, din, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(total, din, generator=g, dtype=torch.float64).to(dtype))


def _check_clip(rank_in_group, world, group, sizes, d, backend, seed, tol, dtype=torch.float64, grad_chunk=None):
    import bigbatch
    from bigbatch import reference
    from bigbatch.distributed import ring_clip_loss

    din = 6
    x_img, x_txt = _data(sizes, din, seed, dtype)
    # single-process truth in float64
    ref_model = _Encoders(din, d, torch.float64, seed)
    fi, ft, s = ref_model(x_img.double(), x_txt.double())
    ref_loss = reference.clip_loss(fi, ft, s)
    ref_loss.backward()
    ref_grads = _grads(ref_model)

    model = _Encoders(din, d, dtype, seed)
    start = sum(sizes[:rank_in_group])
    sl = slice(start, start + sizes[rank_in_group])
    fi, ft, s = model(x_img[sl], x_txt[sl])
    if grad_chunk is None:
        loss = bigbatch.clip_loss(fi, ft, s, group=group, backend=_backend(backend))
    else:  # exercise the chunked backward (several backend calls per ring step)
        from bigbatch.backends import resolve_backend
        from bigbatch.backends.base import compute_dtype

        impl = resolve_backend(_backend(backend), fi.device)
        loss = ring_clip_loss(fi, ft, s.to(compute_dtype(dtype)), group=group, backend=impl, grad_chunk=grad_chunk)
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, group=group)
    mean_loss /= world
    what = f"clip backend={backend} sizes={sizes} d={d}"
    assert _rel(mean_loss, ref_loss) <= tol, f"{what}: loss {mean_loss.item()} vs {ref_loss.item()}"
    for name, g, rg in zip(("img", "txt", "logit_scale"), _ddp_average(model, world, group), ref_grads):
        err = _rel(g, rg)
        assert err <= tol, f"{what}: grad {name} rel err {err:.2e} > {tol:.0e}"


def _check_infonce(rank, world, group, q_sizes, k_sizes, d, backend, seed, reduction, tol, with_labels=True):
    import bigbatch
    from bigbatch import reference

    din = 5
    g = torch.Generator().manual_seed(seed + 7)
    xq = torch.randn(sum(q_sizes), din, generator=g, dtype=torch.float64)
    xk = torch.randn(sum(k_sizes), din, generator=g, dtype=torch.float64)
    if with_labels:  # arbitrary positives anywhere in the global key set
        labels = torch.randint(0, sum(k_sizes), (sum(q_sizes),), generator=g)
    else:  # query i of rank r pairs with key i of rank r
        labels = torch.cat([torch.arange(b) + sum(k_sizes[:r]) for r, b in enumerate(q_sizes)])
    weights = torch.rand(sum(q_sizes), generator=g, dtype=torch.float64)  # for reduction="none"

    def objective(per_row_or_loss, w):
        return (per_row_or_loss * w).sum() if reduction == "none" else per_row_or_loss

    ref_model = _Encoders(din, d, torch.float64, seed)
    fq, fk, s = ref_model(xq, xk)
    ref = reference.infonce_loss(fq, fk, s, labels, reduction=reduction)
    objective(ref, weights).backward()
    ref_grads = _grads(ref_model)

    model = _Encoders(din, d, torch.float64, seed)
    qs = slice(sum(q_sizes[:rank]), sum(q_sizes[: rank + 1]))
    ks = slice(sum(k_sizes[:rank]), sum(k_sizes[: rank + 1]))
    fq, fk, s = model(xq[qs], xk[ks])
    out = bigbatch.infonce_loss(
        fq, fk, s, labels=labels[qs] if with_labels else None, reduction=reduction, group=group,
        backend=_backend(backend),
    )
    what = f"infonce backend={backend} reduction={reduction} q={q_sizes} k={k_sizes}"
    objective(out, weights[qs]).backward()
    if reduction == "none":
        assert out.shape == (q_sizes[rank],), what
        err = torch.tensor(_rel(out, ref[qs]), dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)  # same verdict on every rank
        assert err.item() <= tol, f"{what}: per-row losses rel err {err.item():.2e}"
        # backward of sum_r <w_r, out_r>: the SUM over ranks is the global objective's gradient
        grads = [gr * world for gr in _ddp_average(model, world, group)]
    else:
        mean_out = out.detach().clone()
        dist.all_reduce(mean_out, group=group)
        assert _rel(mean_out / world, ref) <= tol, f"{what}: loss {mean_out.item() / world} vs {ref.item()}"
        grads = _ddp_average(model, world, group)
    for name, g_, rg in zip(("q", "k", "logit_scale"), grads, ref_grads):
        err = _rel(g_, rg)
        assert err <= tol, f"{what}: grad {name} rel err {err:.2e} > {tol:.0e}"


def _check_near_convergence(rank, world, group, sizes, backend, loss_name, tol=2e-2):
    """bf16 features with P_ii ~ 0.985: the LSE and positive gradients nearly cancel, so the
    positive term must join dS in fp32 inside the backend, also for blocks that travel."""
    import math

    import bigbatch
    from bigbatch import reference

    total, d = sum(sizes), 32
    g = torch.Generator().manual_seed(3)
    q = torch.nn.functional.normalize(torch.randn(total, d, generator=g, dtype=torch.float64), dim=1)
    k = torch.nn.functional.normalize(q + 0.05 * torch.randn(total, d, generator=g, dtype=torch.float64), dim=1)
    q, k = q.to(torch.bfloat16).double(), k.to(torch.bfloat16).double()  # the same values in both
    q64, k64 = q.clone().requires_grad_(), k.clone().requires_grad_()
    s64 = torch.tensor(11.0, dtype=torch.float64, requires_grad=True)
    labels = (torch.arange(total) * 7) % total if loss_name == "infonce" else None  # positives off-rank too
    kp = k64 if labels is None else k64.index_select(0, torch.argsort(labels))  # key labels[i] is q_i's pair
    if loss_name == "clip":
        ref = reference.clip_loss(q64, k64, s64)
    else:
        ref = reference.infonce_loss(q64, kp, s64, labels=labels)
    ref_grads = torch.autograd.grad(ref, (q64, k64, s64))
    p_pos = math.exp(-ref.item())
    assert 0.98 < p_pos < 0.9995, f"not near convergence: mean positive probability {p_pos:.4f}"

    sl = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    ql = q[sl].to(torch.bfloat16).requires_grad_()
    kfull = k.to(torch.bfloat16) if labels is None else k.index_select(0, torch.argsort(labels)).to(torch.bfloat16)
    kl = kfull[sl].detach().requires_grad_()
    s = torch.tensor(11.0, requires_grad=True)
    if loss_name == "clip":
        loss = bigbatch.clip_loss(ql, kl, s, group=group, backend=_backend(backend))
    else:
        loss = bigbatch.infonce_loss(ql, kl, s, labels=labels[sl], group=group, backend=_backend(backend))
    loss.backward()
    # key gradients: rank r holds rows sl of the (permuted) key set
    dk_ref = ref_grads[1] if labels is None else ref_grads[1].index_select(0, torch.argsort(labels))
    sq = torch.tensor([((ql.grad.double() / world - ref_grads[0][sl]) ** 2).sum(), (ref_grads[0][sl] ** 2).sum(),
                       ((kl.grad.double() / world - dk_ref[sl]) ** 2).sum(), (dk_ref[sl] ** 2).sum()],
                      dtype=torch.float64)
    dist.all_reduce(sq, group=group)
    ds = s.grad.detach().double().clone()
    dist.all_reduce(ds, group=group)
    what = f"near convergence {loss_name} backend={backend}"
    assert (sq[0] / sq[1]).sqrt() <= tol, f"{what}: dq rel err {(sq[0] / sq[1]).sqrt():.2e}"
    assert (sq[2] / sq[3]).sqrt() <= tol, f"{what}: dk rel err {(sq[2] / sq[3]).sqrt():.2e}"
    err_s = abs(ds.item() / world - ref_grads[2].item()) / abs(ref_grads[2].item())
    assert err_s <= tol, f"{what}: d(scale) rel err {err_s:.2e}"


def _expect_error(fn, *needles):
    try:
        fn()
    except ValueError as exc:
        msg = str(exc)
        for needle in needles:
            assert needle in msg, f"error message {msg!r} lacks {needle!r}"
        return msg
    raise AssertionError(f"no ValueError raised (expected one mentioning {needles})")


def _errors(rank, world):
    """Inconsistent input across ranks: the same ValueError on EVERY rank, no hang."""
    import bigbatch

    group = dist.group.WORLD
    f = lambda b, d, dt=torch.float64: torch.randn(b, d, dtype=dt)  # noqa: E731
    # feature dimension differs
    d = 4 if rank == 0 else 5
    _expect_error(lambda: bigbatch.clip_loss(f(3, d), f(3, d), 1.0, group=group, backend="torch"), "dim", "[4, 5]")
    # dtype differs
    dt = torch.float32 if rank == 0 else torch.float64
    _expect_error(lambda: bigbatch.clip_loss(f(3, 4, dt), f(3, 4, dt), 1.0, group=group, backend="torch"),
                  "dtype", "torch.float32", "torch.float64")
    # CLIP rows differ between modalities on one rank only
    n = 3 if rank == 0 else 2
    _expect_error(lambda: bigbatch.clip_loss(f(3, 4), f(n, 4), 1.0, group=group, backend="torch"),
                  "rank(s) [1]", "same number of rows")
    # labels outside the GLOBAL key set (valid locally on rank 0, 5 keys in all)
    lab = torch.tensor([0, 4]) if rank == 0 else torch.tensor([1, 5])
    _expect_error(lambda: bigbatch.infonce_loss(f(2, 4), f(3 if rank == 0 else 2, 4), 1.0, labels=lab,
                                                group=group, backend="torch"), "[0, 5)", "rank 1: [1, 5]")
    # labels of the wrong dtype on one rank (that rank raises its own TypeError: test_distributed_local_errors)
    if rank == 0:
        lab = torch.tensor([0, 1])
        _expect_error(lambda: bigbatch.infonce_loss(f(2, 4), f(2, 4), 1.0, labels=lab, group=group, backend="torch"),
                      "integer dtype")
    else:
        with pytest.raises(TypeError, match="integer dtype"):
            bigbatch.infonce_loss(f(2, 4), f(2, 4), 1.0, labels=torch.tensor([0.0, 1.0]), group=group, backend="torch")
    # scale differs
    _expect_error(lambda: bigbatch.clip_loss(f(3, 4), f(3, 4), 1.0 + rank, group=group, backend="torch"), "scale")
    # reference on one rank, ring on the other (different collectives)
    be = "reference" if rank == 0 else "torch"
    _expect_error(lambda: bigbatch.clip_loss(f(3, 4), f(3, 4), 1.0, group=group, backend=be), "backend's kind",
                  "['reference', 'a tile backend']")
    # reductions differ: named as passed
    red = "mean" if rank == 0 else "sum"
    _expect_error(lambda: bigbatch.infonce_loss(f(3, 4), f(3, 4), 1.0, reduction=red, group=group, backend="torch"),
                  "reduction", "['mean', 'sum']")
    # clip_loss on one rank, infonce_loss on the other
    fn = bigbatch.clip_loss if rank == 0 else bigbatch.infonce_loss
    _expect_error(lambda: fn(f(3, 4), f(3, 4), 1.0, group=group, backend="torch"), "['clip', 'infonce']")
    # clip_loss on one rank, siglip_loss on the other: exchanges of other fields (gloo aborted the
    # process on the size mismatch); and siglip_loss on one rank, clip_loss on the other
    for first in (bigbatch.clip_loss, bigbatch.siglip_loss):
        if (rank == 0) == (first is bigbatch.clip_loss):
            call = lambda: bigbatch.clip_loss(f(3, 4), f(3, 4), 1.0, group=group, backend="torch")  # noqa: E731
        else:
            call = lambda: bigbatch.siglip_loss(f(3, 4), f(3, 4), 1.0, -1.0, group=group, backend="torch")  # noqa: E731
        _expect_error(call, "called different collectives", "clip_loss(group=...)", "siglip_loss")
    # gradients wanted on one rank only: its backward would wait forever for the others
    x = f(3, 4).requires_grad_(rank == 0)
    _expect_error(lambda: bigbatch.clip_loss(x, f(3, 4), 1.0, group=group, backend="torch"),
                  "whether a gradient is wanted", "['yes', 'no']")
    # the sigmoid ring too (its gradient ring sends more messages than the loss-only one; before: a hang)
    x = f(3, 4).requires_grad_(rank == 0)
    _expect_error(lambda: bigbatch.siglip_loss(x, f(3, 4), 1.0, -1.0, group=group, backend="torch"),
                  "whether a gradient is wanted")
    s = torch.tensor(1.0, dtype=torch.float64, requires_grad=rank == 1)
    _expect_error(lambda: bigbatch.siglip_loss(f(3, 4), f(3, 4), s, -1.0, group=group, backend="torch"),
                  "whether a gradient is wanted")
    # an int scale beyond float range on one rank: a ValueError there, shared with the others
    for loss in ("clip", "siglip"):
        big = 10**400 if rank == 0 else 1.0
        call = (lambda: bigbatch.clip_loss(f(3, 4), f(3, 4), big, group=group, backend="torch")) if loss == "clip" \
            else (lambda: bigbatch.siglip_loss(f(3, 4), f(3, 4), big, 0.0, group=group, backend="torch"))
        _expect_error(call, "scale")
    # features on a CPU on one rank and a GPU on another (a mixed cpu:gloo,cuda:nccl group would
    # send them through different transports): the device type is agreed (simulated on the CPU)
    import bigbatch.distributed.ring as ring_mod

    real_code = ring_mod.device_code
    ring_mod.device_code = lambda device: float(rank)
    try:
        _expect_error(lambda: bigbatch.clip_loss(f(3, 4), f(3, 4), 1.0, group=group, backend="torch"),
                      "the features' device type", "['cpu', 'cuda']")
        _expect_error(lambda: bigbatch.siglip_loss(f(3, 4), f(3, 4), 1.0, -1.0, group=group, backend="torch"),
                      "the features' device type", "['cpu', 'cuda']")
    finally:
        ring_mod.device_code = real_code
    # after all those errors the group still works
    out = bigbatch.clip_loss(f(3, 4), f(3, 4), 1.0, group=group, backend="torch")
    assert torch.isfinite(out)
    # NaN in one rank's features is never turned into a finite loss, on any rank
    x = f(3, 4)
    if rank == 1:
        x[1, 2] = float("nan")
    for be in ("torch", "reference"):
        out = bigbatch.clip_loss(x, f(3, 4), 1.0, group=group, backend=be)
        assert torch.isnan(out), f"backend {be}: NaN features gave loss {out.item()} on rank {rank}"


def _random_shapes(rank, world):
    """Property-based: random uneven shards, odd D, tiles and chunks that don't divide them.

    Every rank draws the same examples (derandomized), and every assertion compares values
    that are identical on all ranks (all-reduced), so a failure and its shrinking stay in step.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    group = dist.group.WORLD

    @settings(max_examples=12, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(
        q_sizes=st.lists(st.integers(1, 7), min_size=world, max_size=world),
        extra=st.lists(st.integers(0, 4), min_size=world, max_size=world),
        d=st.integers(1, 9),
        backend=st.sampled_from(["torch", "torch_small_tiles", "reference"]),
        chunk=st.sampled_from([None, 1, 2, 3]),
        seed=st.integers(0, 2**16),
    )
    def prop(q_sizes, extra, d, backend, chunk, seed):
        be = "torch" if (chunk is not None and backend == "reference") else backend
        _check_clip(rank, world, group, q_sizes, d, be, seed=seed, tol=1e-10, grad_chunk=chunk)
        k_sizes = [b + e for b, e in zip(q_sizes, extra)]
        _check_infonce(rank, world, group, q_sizes, k_sizes, d, backend, seed=seed, reduction="mean", tol=1e-10)

    prop()


def _mixed_requires_grad(rank, world):
    """Ranks differ in which features require grad (rank 0: queries, rank 1: keys), or ask
    autograd.grad for different ones: the gather-with-grad reference must run the same collective
    on every rank and equal the ring (before: wrong gradients for CLIP, a hang for InfoNCE)."""
    import bigbatch

    g = torch.Generator().manual_seed(40 + rank)
    q0, k0 = torch.randn(3 + rank, 4, generator=g, dtype=torch.float64), torch.randn(3 + rank, 4, generator=g, dtype=torch.float64)
    for name in ("clip", "infonce"):
        fn = bigbatch.clip_loss if name == "clip" else bigbatch.infonce_loss
        for how in ("one_side", "grad_of_different_tensors"):
            got = {}
            for backend in ("reference", "torch"):
                q, k = q0.clone().requires_grad_(rank == 0 or how != "one_side"), k0.clone().requires_grad_(rank == 1 or how != "one_side")
                loss = fn(q, k, 3.0, group=dist.group.WORLD, backend=backend)
                got[backend] = torch.autograd.grad(loss, q if rank == 0 else k)[0]
            assert _rel(got["reference"], got["torch"]) < 1e-12, (name, how, rank)
        dist.barrier()


def _two_ranks(rank, world, triton_ok):
    group = dist.group.WORLD
    _mixed_requires_grad(rank, world)
    sizes = [5, 3]
    for backend in ("reference", "torch", "torch_small_tiles"):
        _check_clip(rank, world, group, sizes, 7, backend, seed=1, tol=1e-10)
    _check_clip(rank, world, group, [4, 9], 3, "torch", seed=2, tol=1e-10, grad_chunk=2)
    _check_clip(rank, world, group, [1, 6], 5, "torch_small_tiles", seed=5, tol=1e-10, grad_chunk=4)
    # half precision inputs, fp32 accumulation: compared with the float64 truth, loosely
    _check_clip(rank, world, group, [6, 4], 8, "torch", seed=3, tol=2e-2, dtype=torch.bfloat16)
    _check_clip(rank, world, group, [6, 4], 8, "torch", seed=3, tol=3e-6, dtype=torch.float32)
    if triton_ok:  # under the interpreter on CPU: tiny fp32 shapes
        _check_clip(rank, world, group, [5, 3], 4, "triton", seed=4, tol=1e-4, dtype=torch.float32)
    for reduction in ("mean", "sum", "none"):
        for backend in ("reference", "torch"):
            _check_infonce(rank, world, group, [3, 4], [5, 7], 6, backend, seed=11, reduction=reduction, tol=1e-10)
    _check_infonce(rank, world, group, [3, 4], [5, 7], 6, "torch_small_tiles", seed=12, reduction="mean",
                   tol=1e-10, with_labels=False)
    _errors(rank, world)
    _random_shapes(rank, world)
    for loss_name in ("clip", "infonce"):
        _check_near_convergence(rank, world, group, [50, 46], "torch_small_tiles", loss_name)
        if triton_ok:
            _check_near_convergence(rank, world, group, [50, 46], "triton", loss_name)
    return True


def _three_ranks(rank, world, triton_ok):
    from bigbatch.distributed import Ring

    world_group = dist.group.WORLD
    # the primitive: blocks of different sizes go once around the ring
    ring = Ring.of(world_group)
    sizes = [2, 5, 3]
    blk = torch.full((sizes[rank], 2), float(rank))
    for t in range(world - 1):
        nxt = ring.block_at(t + 1)
        blk = ring.shift([blk], [torch.empty(sizes[nxt], 2)]).wait()[0]
        assert blk.shape == (sizes[nxt], 2) and bool((blk == nxt).all()), f"step {t}: got block {blk}"

    _check_clip(rank, world, world_group, [4, 1, 6], 5, "torch", seed=21, tol=1e-10)
    _check_clip(rank, world, world_group, [2, 3, 2], 3, "reference", seed=22, tol=1e-10)
    if triton_ok:
        _check_clip(rank, world, world_group, [3, 2, 4], 4, "triton", seed=23, tol=1e-4, dtype=torch.float32)
    for reduction in ("mean", "none"):
        _check_infonce(rank, world, world_group, [2, 3, 1], [4, 2, 5], 4, "torch", seed=24, reduction=reduction,
                       tol=1e-10)

    # a subgroup that is not WORLD and not contiguous: global ranks {0, 2}
    sub = dist.new_group([0, 2])
    if rank == 1:
        import bigbatch

        _expect_error(lambda: bigbatch.clip_loss(torch.randn(2, 3, dtype=torch.float64),
                                                 torch.randn(2, 3, dtype=torch.float64), 1.0, group=sub,
                                                 backend="torch"), "not a member")
    else:
        sub_rank = dist.get_rank(sub)
        _check_clip(sub_rank, 2, sub, [3, 5], 4, "torch", seed=25, tol=1e-10)
        _check_infonce(sub_rank, 2, sub, [2, 4], [3, 3], 4, "torch", seed=26, reduction="sum", tol=1e-10)
    dist.barrier()
    return True


def test_ring_two_ranks():
    assert run_gloo(_two_ranks, 2, HAS_TRITON_BACKEND) == [True, True]


def test_ring_three_ranks_and_subgroup():
    assert run_gloo(_three_ranks, 3, HAS_TRITON_BACKEND) == [True, True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ring_nccl_two_gpus(tmp_path):
    """NCCL + the GPU backend: the benchmark's float64 checks (bf16/fp32, uneven shards) must pass."""
    import json
    import subprocess
    import sys

    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "bigbatch.bench.ring",
           "--batches", "16384", "--peers", "ring", "--check-batch", "8192", "--repeat", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    bad = [c for c in payload["checks"] if not c["ok"]]
    assert not bad, f"checks beyond tolerance: {bad}"
    assert payload["rows"][0]["status"] == "ok"


def _values_on_every_rank(rank: int, world: int):
    """Each loss's returned value on this rank: clean shards, then a NaN in rank 1's queries."""
    import bigbatch

    sizes = [1, 5, 3][:world]
    start = sum(sizes[:rank])
    g = torch.Generator().manual_seed(7)
    q_all, k_all = torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64), torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
    out = []
    for poison in (False, True):
        q, k = q_all[start:start + sizes[rank]].clone(), k_all[start:start + sizes[rank]].clone()
        if poison and rank == 1:
            q[0, 1] = float("nan")
        for name, backend in (("clip", "torch"), ("clip", "reference"), ("infonce", "torch"), ("infonce", "reference"),
                              ("infonce_sum", "torch"), ("siglip", "torch")):
            qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
            if name == "siglip":
                value = bigbatch.siglip_loss(qq, kk, 3.0, -1.0, group=dist.group.WORLD, backend=backend)
            elif name == "infonce_sum":
                value = bigbatch.infonce_loss(qq, kk, 3.0, reduction="sum", group=dist.group.WORLD, backend=backend)
            else:
                value = getattr(bigbatch, f"{name}_loss")(qq, kk, 3.0, group=dist.group.WORLD, backend=backend)
            value.backward()  # the backward is a collective: every rank runs it
            out.append(((name, backend, poison), value.item(), qq.grad.clone()))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_returns_the_global_loss_and_sees_a_nan(world):
    """The value on every rank is the global loss (its gradient is still the rank's share: the
    averaged gradients are checked elsewhere), so a NaN in one rank's queries is a NaN everywhere
    (before, the other ranks got a finite share and a finite-loss guard hung the ring)."""
    import bigbatch
    from bigbatch import reference

    per_rank = run_gloo(_values_on_every_rank, world, timeout=240.0)
    sizes = [1, 5, 3][:world]
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64), torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
    want = {"clip": reference.clip_loss(q, k, 3.0).item(), "infonce": reference.infonce_loss(q, k, 3.0).item(),
            "infonce_sum": bigbatch.infonce_loss(q, k, 3.0, reduction="sum", backend="reference").item(),
            "siglip": reference.siglip_loss(q, k, 3.0, -1.0).item()}
    for i, ((name, backend, poison), _, _) in enumerate(per_rank[0]):
        values = [r[i][1] for r in per_rank]
        if poison:
            assert all(v != v for v in values), (name, backend, values)
        else:
            assert all(abs(v - want[name]) <= 1e-12 * abs(want[name]) for v in values), (name, backend, values, want[name])


def _global_value_inf(rank: int, world: int):
    from bigbatch.distributed.ring import Ring, global_value

    local = torch.tensor([float("inf"), 2.0][rank], dtype=torch.float64, requires_grad=True)
    value = global_value(Ring.of(dist.group.WORLD), local * 3)
    value.backward()
    return value.item(), local.grad.item()


def test_global_value_keeps_an_infinite_loss_and_the_share_gradient():
    """value = the mean over ranks (inf if any rank's share is inf, on every rank: inf - inf
    would have made it NaN on the inf rank only), gradient = the rank's own share's."""
    (v0, g0), (v1, g1) = run_gloo(_global_value_inf, 2, timeout=120.0)
    assert v0 == v1 == float("inf") and g0 == g1 == 3.0


def _half_gather_errors(rank: int, world: int):
    import bigbatch

    g = torch.Generator().manual_seed(11)
    q64, k64 = torch.randn(world * 128, 32, generator=g, dtype=torch.float64), \
        torch.randn(world * 128, 32, generator=g, dtype=torch.float64)
    q64, k64 = q64 / q64.norm(dim=1, keepdim=True), k64 / k64.norm(dim=1, keepdim=True)
    ref = [t.clone().requires_grad_() for t in (q64, k64)]
    bigbatch.clip_loss(*ref, 50.0, backend="reference").backward()
    rows = slice(rank * 128, (rank + 1) * 128)

    def err(grads):  # on this rank's rows
        return max(_rel(gr.double(), r.grad[rows]) for gr, r in zip(grads, ref))

    one = [t.to(torch.bfloat16).requires_grad_() for t in (q64, k64)]
    bigbatch.clip_loss(*one, 50.0, backend="reference").backward()
    shard = [t[rows].to(torch.bfloat16).requires_grad_() for t in (q64, k64)]
    bigbatch.clip_loss(*shard, 50.0, backend="reference", group=dist.group.WORLD).backward()
    # each rank's gradient is world x its share of the global gradient (DDP averages it back)
    return err([t.grad[rows] for t in one]), err([t.grad / world for t in shard])


def test_gather_path_sums_half_precision_gradients_in_fp32():
    """backend='reference' with a group summed the ranks' bf16 gradients in bf16 (1.5x the
    one-process error at 4 ranks); now in fp32, rounded once: the one-process error."""
    for one, gathered in run_gloo(_half_gather_errors, 2, timeout=120.0):
        assert gathered <= 1.05 * one, (gathered, one)
