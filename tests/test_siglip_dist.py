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
    cases = CASES[world]
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
    return out


def test_bad_input_on_one_rank_raises_on_every_rank():
    per_rank = run_gloo(_bad_worker, 2)
    shape_msgs = [r[0] for r in per_rank]
    scale_msgs = [r[1] for r in per_rank]
    assert all(m is not None and "rank(s) [1]" in m and "text_features" in m for m in shape_msgs), shape_msgs
    assert all(m is not None and "scale" in m for m in scale_msgs), scale_msgs
