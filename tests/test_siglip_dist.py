"""siglip_loss over real 2- and 3-process gloo groups: exact under DDP-style averaging.

Each rank gets a shard (sizes may differ) of one global float64 batch; the mean over ranks of
the returned losses must be the global loss, and the gradients averaged over ranks (what DDP
does) must equal the single-process gradients for the features, the scale and the bias.
"""

from __future__ import annotations

import pytest
import torch

from bigbatch import reference

from distributed_harness import run_gloo
from helpers import assert_rel

D = 7


def _global_batch(sizes, with_labels, seed=1):
    g = torch.Generator().manual_seed(seed)
    b = sum(sizes)
    q = torch.randn(b, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (b,), generator=g) if with_labels else None
    return q, k, labels


def _run_case(rank, sizes, with_labels, backend_name, dtype, chunk_rows=None):
    import torch.distributed as dist

    import bigbatch
    from bigbatch.backends.torch_sigmoid import TorchSigmoid
    from bigbatch.distributed.sigmoid import ring_siglip_loss

    q, k, labels = _global_batch(sizes, with_labels)
    off = sum(sizes[:rank])
    sl = slice(off, off + sizes[rank])
    ql = q[sl].clone().to(dtype).requires_grad_()
    kl = k[sl].clone().to(dtype).requires_grad_()
    log_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    backend = TorchSigmoid(tile_rows=3, tile_cols=2) if backend_name == "tiles" else backend_name
    lab = None if labels is None else labels[sl]
    if chunk_rows is None:  # the public entry points, the memory rule's chunks
        loss = bigbatch.SigLipLoss(group=dist.group.WORLD, backend=backend)(ql, kl, log_scale.exp(), bias, labels=lab)
    else:  # forced small chunks: several per block, tails, empty chunks of small blocks
        loss = ring_siglip_loss(
            ql, kl, log_scale.exp(), bias, labels=lab, group=dist.group.WORLD, backend=backend, chunk_rows=chunk_rows
        )
    loss.backward()
    with torch.no_grad():  # the loss-only ring pass gives the same value
        loss_ng = ring_siglip_loss(
            ql, kl, log_scale.exp(), bias, labels=lab, group=dist.group.WORLD, backend=backend, chunk_rows=chunk_rows
        )
    return loss.detach(), loss_ng, ql.grad, kl.grad, log_scale.grad, bias.grad


def _neighbour_exchange_case(rank, world):
    """The benchmark's peer (OpenCLIP's neighbour exchange, even shards) must be right too."""
    import torch.distributed as dist

    from bigbatch.bench.siglip import neighbour_exchange_siglip

    sizes = [4] * world
    q, k, _ = _global_batch(sizes, False)
    sl = slice(4 * rank, 4 * rank + 4)
    ql, kl = q[sl].clone().requires_grad_(), k[sl].clone().requires_grad_()
    log_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    loss = neighbour_exchange_siglip(ql, kl, log_scale.exp(), bias, dist.group.WORLD)
    loss.backward()
    return loss.detach(), loss.detach(), ql.grad, kl.grad, log_scale.grad, bias.grad


def _weighted_case(rank, world, sizes, chunk_rows=None):
    """Ranks back-propagate different upstream gradients (loss_r * (r + 1))."""
    import torch.distributed as dist

    from bigbatch.distributed.sigmoid import ring_siglip_loss

    q, k, labels = _global_batch(sizes, True)
    off = sum(sizes[:rank])
    sl = slice(off, off + sizes[rank])
    ql, kl = q[sl].clone().requires_grad_(), k[sl].clone().requires_grad_()
    log_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    loss = ring_siglip_loss(
        ql, kl, log_scale.exp(), bias, labels=labels[sl], group=dist.group.WORLD, backend="torch", chunk_rows=chunk_rows
    )
    (loss * (rank + 1)).backward()
    return loss.detach(), loss.detach(), ql.grad, kl.grad, log_scale.grad, bias.grad


def _worker(rank, world, cases):
    # Several cases per process group: spawning processes costs more than the cases themselves.
    return (
        [_run_case(rank, *case) for case in cases]
        + [_neighbour_exchange_case(rank, world)]
        + [_weighted_case(rank, world, WEIGHTED_SIZES[world], chunk) for chunk in (None, 2)]
    )


def _check(results, sizes, with_labels, tol):
    q, k, labels = _global_batch(sizes, with_labels)
    q.requires_grad_(True)
    k.requires_grad_(True)
    log_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    ref = reference.siglip_loss(q, k, log_scale.exp(), bias, labels)
    ref.backward()
    w = len(sizes)
    mean = lambda i: sum(r[i] for r in results) / w  # noqa: E731 - DDP averages over ranks
    assert_rel(mean(0), ref.detach(), tol, "loss (mean over ranks)")
    assert_rel(mean(1), ref.detach(), tol, "no-grad loss (mean over ranks)")
    assert_rel(torch.cat([r[2] for r in results]) / w, q.grad, tol, "d image (averaged)")
    assert_rel(torch.cat([r[3] for r in results]) / w, k.grad, tol, "d text (averaged)")
    assert_rel(mean(4), log_scale.grad, tol, "d log_scale (averaged)")
    assert_rel(mean(5), bias.grad, tol, "d bias (averaged)")


# (sizes, labels?, backend, dtype, tolerance, chunk_rows): None = the memory rule (one chunk per
# block at these sizes); small values give several chunks per block, tails, and (blocks smaller
# than the chunk count) empty chunks, whose transfers every rank must skip alike.
CASES = {
    2: [
        ([5, 3], False, "tiles", torch.float64, 1e-12, None),
        ([2, 6], True, "auto", torch.float32, 1e-5, None),
        ([7, 2], False, "tiles", torch.float64, 1e-12, 2),
        ([5, 6], True, "torch", torch.float64, 1e-12, 4),
        ([9, 4], True, "triton", torch.float32, 1e-5, 3),
        ([3, 5], False, "triton", torch.float16, 5e-3, 2),  # (the interpreter mishandles bf16)
    ],
    3: [
        ([4, 1, 6], True, "tiles", torch.float64, 1e-12, None),
        ([3, 3, 3], False, "tiles", torch.float64, 1e-12, None),
        ([6, 2, 5], True, "auto", torch.float32, 1e-5, None),
        ([4, 1, 6], True, "tiles", torch.float64, 1e-12, 2),
        ([5, 8, 3], False, "torch", torch.float64, 1e-12, 1),
        ([6, 2, 7], True, "triton", torch.float32, 1e-5, 3),
    ],
}


@pytest.mark.parametrize("world", [2, 3])
def test_ring_matches_single_process(world):
    # gloo moves CPU tensors: Triton cases run under the interpreter, on CPU-only machines only (on a
    # GPU machine the kernels are tested in test_siglip_triton.py; Triton 3.6's interpreter fails
    # with numpy 2)
    cases = [c for c in CASES[world] if c[2] != "triton" or not torch.cuda.is_available()]
    per_rank = run_gloo(_worker, world, [c[:4] + c[5:] for c in cases])
    for i, (sizes, with_labels, _, _, tol, _) in enumerate(cases):
        _check([r[i] for r in per_rank], sizes, with_labels, tol)
    _check([r[-3] for r in per_rank], [4] * world, False, 1e-12)
    _check_weighted([r[-2] for r in per_rank], WEIGHTED_SIZES[world])
    _check_weighted([r[-1] for r in per_rank], WEIGHTED_SIZES[world])


WEIGHTED_SIZES = {2: [3, 5], 3: [2, 5, 3]}


def _check_weighted(results, sizes):
    """Each rank's gradients are those of sum_r (r + 1) * loss_r (its own share for the scalars)."""
    q, k, labels = _global_batch(sizes, True)
    q.requires_grad_(True)
    k.requires_grad_(True)
    log_scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    logits = log_scale.exp() * q @ k.t() + bias
    z = (labels[:, None] == labels[None, :]).double() * 2 - 1
    per_row = -torch.nn.functional.logsigmoid(z * logits).sum(dim=1)
    w = len(sizes)
    weights = torch.cat([torch.full((n,), float(r + 1), dtype=torch.float64) for r, n in enumerate(sizes)])
    target = (weights * per_row).sum() * w / sum(sizes)
    target.backward()
    assert_rel(torch.cat([r[2] for r in results]), q.grad, 1e-12, "d image (weighted)")
    assert_rel(torch.cat([r[3] for r in results]), k.grad, 1e-12, "d text (weighted)")
    assert_rel(sum(r[4] for r in results), log_scale.grad, 1e-12, "d log_scale (weighted, summed shares)")
    assert_rel(sum(r[5] for r in results), bias.grad, 1e-12, "d bias (weighted, summed shares)")


def _bad_worker(rank, world):
    import torch.distributed as dist

    import bigbatch

    out = []
    q = torch.randn(4, 5)
    k = torch.randn(4 if rank == 0 else 3, 5)  # rank 1 passes mismatched shapes
    for scale, kk in ((2.0, k), (2.0 + rank, q.clone())):  # then: scale differs between ranks
        try:
            bigbatch.siglip_loss(q, kk, scale, 0.0, group=dist.group.WORLD)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    from bigbatch.distributed.sigmoid import ring_siglip_loss

    for chunk in (0 if rank == 1 else 4, 4 + rank):  # invalid on rank 1; then different per rank
        try:
            ring_siglip_loss(q, q.clone(), 2.0, 0.0, group=dist.group.WORLD, chunk_rows=chunk)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_bad_input_on_one_rank_raises_on_every_rank():
    per_rank = run_gloo(_bad_worker, 2)
    shape_msgs = [r[0] for r in per_rank]
    scale_msgs = [r[1] for r in per_rank]
    assert all(m is not None and "rank(s) [1]" in m and "text_features" in m for m in shape_msgs), shape_msgs
    assert all(m is not None and "scale" in m for m in scale_msgs), scale_msgs
    assert all(r[2] is not None and "rank(s) [1]" in r[2] and "chunk_rows" in r[2] for r in per_rank), per_rank
    assert all(r[3] is not None and "chunk_rows must be the same" in r[3] for r in per_rank), per_rank


# ---- memory: the ring's buffers come out of the one-GPU budget ------------------------------


def _slots_worker(rank, world):
    """Run the ring pass with a backend of a given workspace; report what it allocated and was told."""
    import torch.distributed as dist

    from bigbatch.backends.torch_sigmoid import TorchSigmoid
    from bigbatch.distributed.ring import Ring
    from bigbatch.distributed.sigmoid import _plan_and_backend, _ring_pass

    out = []
    sizes = [1500, 1100, 1300][:world]  # over the 1024-row floor: the rule cuts 2 chunks per block
    ring = Ring.of(dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(sizes[rank], D, generator=g)
    k = torch.randn(sizes[rank], D, generator=g)
    ids = torch.arange(sizes[rank]) % 4
    for labels in (None, ids):
        plan, backend = _plan_and_backend(TorchSigmoid(workspace_bytes=300_000), sizes, q, labels, True, None)
        stats = {}
        one = torch.tensor(1.0)
        _ring_pass(ring, sizes, q, k, labels, one, one, backend, plan, True, stats=stats)
        out.append((plan, stats["slot_bytes"], backend.workspace_bytes))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ring_allocates_its_plan_within_the_one_gpu_workspace(world):
    for rank_result in run_gloo(_slots_worker, world):
        for plan, slot_bytes, told in rank_result:
            assert plan.chunks == 2  # a small workspace cuts several chunks per block
            assert slot_bytes == plan.slot_bytes > 0
            assert told == plan.backend_workspace
            assert plan.backend_workspace == plan.workspace // 4 and plan.workspace <= 300_000  # the floor
            assert plan.k_slots == min(2, world - 1) and plan.dk_slots == 3


def _one_gpu(b, d, dtype, workspace):
    from bigbatch.distributed.sigmoid import plan_ring

    return plan_ring([b], d, dtype, with_grad=True, workspace=workspace)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_plan_ring_fits_the_one_gpu_budget(dtype, world):
    """Per rank, fp32 dq + own dk + slots + the backend's share <= one GPU at the same local batch
    (W = what the backend allocates for a b x b problem on a GPU), for the largest shard; a smaller
    shard exceeds its own one-GPU value by at most the slots (they are sized by the largest)."""
    from bigbatch.backends.torch_sigmoid import TorchSigmoid
    from bigbatch.backends.triton_sigmoid import TritonSigmoid
    from bigbatch.distributed.sigmoid import plan_ring, transient_bytes

    cuda = torch.device("cuda")
    for backend in (TritonSigmoid(), TorchSigmoid()):
        for b, d in ((131072, 512), (262144, 512), (4096, 512), (8192, 768), (32768, 1024), (65536, 4096)):
            for ids in (0, 8):
                small = b // 3 + 1
                sizes = [b] * (world - 1) + [small]  # uneven shards: chunks are cut from the largest
                w_big = backend.workspace_for(b, b, d, dtype, cuda)
                w_small = backend.workspace_for(small, small, d, dtype, cuda)
                plan = plan_ring(sizes, d, dtype, with_grad=True, workspace=w_big, id_itemsize=ids)
                assert transient_bytes(b, d, dtype, plan) <= transient_bytes(b, d, dtype, _one_gpu(b, d, dtype, w_big))
                assert plan.slot_bytes <= w_big // 2
                assert plan.chunks * plan.chunk_rows >= b > (plan.chunks - 1) * plan.chunk_rows
                assert sum(plan.chunk(b, c).stop - plan.chunk(b, c).start for c in range(plan.chunks)) == b
                low = plan_ring(sizes, d, dtype, with_grad=True, workspace=w_small, chunk_workspace=w_big, id_itemsize=ids)
                assert (low.chunks, low.chunk_rows) == (plan.chunks, plan.chunk_rows)  # agreed on every rank
                one_small = transient_bytes(small, d, dtype, _one_gpu(small, d, dtype, w_small))
                assert transient_bytes(small, d, dtype, low) <= one_small + low.slot_bytes
    # 2 ranks, bf16, D = 512, Triton's 512 MiB: 8 chunks of 32768 rows at b = 262144, 224 MiB of slots.
    plan = plan_ring([262144] * 2, 512, torch.bfloat16, with_grad=True, workspace=1 << 29)
    assert (plan.chunks, plan.chunk_rows, plan.slot_bytes) == (8, 32768, 32768 * 512 * (2 + 3 * 4))
    # Without gradients only the text travels: no dk slots.
    assert plan_ring([100, 50], 64, torch.float32, with_grad=False, workspace=1 << 20).dk_slots == 0


def test_plan_ring_floors_are_documented():
    """Where the 1024-row floor bites, the ring exceeds one GPU by the documented amount."""
    from bigbatch.backends.triton_sigmoid import TritonSigmoid
    from bigbatch.distributed.sigmoid import plan_ring, transient_bytes

    # Huge D: 1024-row chunks exceed 3W/4; the backend keeps W/4.
    w = 1 << 29
    plan = plan_ring([4096] * 3, 32768, torch.float32, with_grad=True, workspace=w)
    assert plan.chunk_rows == 1024 and plan.backend_workspace == w // 4
    one = _one_gpu(4096, 32768, torch.float32, w)
    excess = transient_bytes(4096, 32768, torch.float32, plan) - transient_bytes(4096, 32768, torch.float32, one)
    assert excess == plan.slot_bytes + w // 4 - w > 0
    # Tiny local batch (one GPU's G tile is b^2 * 2 bytes): below b ~ 2,700 at D = 512, bf16, 2 ranks.
    cuda = torch.device("cuda")
    for b, fits in ((2048, False), (2800, True)):
        w = TritonSigmoid().workspace_for(b, b, 512, torch.bfloat16, cuda)
        plan = plan_ring([b, b], 512, torch.bfloat16, with_grad=True, workspace=w)
        one = transient_bytes(b, 512, torch.bfloat16, _one_gpu(b, 512, torch.bfloat16, w))
        assert (transient_bytes(b, 512, torch.bfloat16, plan) <= one) == fits


def test_backend_workspace_bytes():
    from bigbatch.backends.torch_sigmoid import TorchSigmoid
    from bigbatch.backends.triton_sigmoid import TritonSigmoid

    cuda = torch.device("cuda")
    t = TritonSigmoid(workspace_bytes=3 << 20)
    assert t.workspace_budget(cuda) == 3 << 20 and t.with_workspace(1 << 20).workspace_budget(cuda) == 1 << 20
    assert t.workspace_for(100000, 100000, 512, torch.bfloat16, cuda) <= 3 << 20
    assert TritonSigmoid().workspace_for(1000, 3000, 64, torch.float16, cuda) == 1000 * 3000 * 2  # small: all of it
    for m, n in ((262144, 32768), (262144, 1000), (5000, 7), (100, 100000)):
        rows, cols = t._tiles(m, n, 2, cuda)
        assert rows * cols * 2 <= 3 << 20 and rows <= m and cols <= n
        assert rows * cols * 2 > (3 << 20) // 4 or (rows == m and cols == n) or cols == n  # narrow chunks: rows grow
    assert TritonSigmoid()._tiles(262144, 262144, 2, cuda) == (16384, 16384)  # the one-GPU tile is unchanged
    assert TorchSigmoid(workspace_bytes=1 << 20).with_workspace(5).workspace_bytes == 5
    for cls in (TritonSigmoid, TorchSigmoid):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="workspace_bytes"):
                cls(workspace_bytes=bad)


def _random_worker(rank, world, configs):
    return [_run_case(rank, sizes, labels, "torch", torch.float64, chunk) for sizes, labels, chunk in configs]


def test_ring_random_shards_and_chunks():
    """Random uneven shards (some smaller than the chunk count: empty chunks) and chunk sizes, 3 ranks."""
    g = torch.Generator().manual_seed(7)
    configs = []
    for _ in range(12):
        sizes = torch.randint(1, 10, (3,), generator=g).tolist()
        chunk = int(torch.randint(1, max(sizes) + 2, (1,), generator=g))
        configs.append((sizes, bool(torch.randint(0, 2, (1,), generator=g)), chunk))
    per_rank = run_gloo(_random_worker, 3, configs)
    for i, (sizes, labels, _) in enumerate(configs):
        _check([r[i] for r in per_rank], sizes, labels, 1e-12)


def test_ring_benchmark_cpu_dry_run_defaults_to_tiny_sizes(tmp_path):
    """`torchrun ... -m bigbatch.bench.siglip --ring --cpu` with no size options kept the GPU sizes
    (a float64 check at B=8192, batches to 262,144): the processes were killed for memory."""
    import json
    import subprocess
    import sys

    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "bigbatch.bench.siglip",
           "--ring", "--cpu", "--repeat", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    payload = json.loads(out.read_text(), parse_constant=refuse)  # no NaN for what the CPU does not measure
    verdicts = [row["ring_no_larger"] for row in payload["memory_summary"]]
    assert verdicts and all(v is None for v in verdicts), verdicts  # no memory measured: no verdict
