"""GradCache under a real 2-process gloo DDP group, and FSDP refused with a reason.

Each rank holds half of the global batch; the loss is either bigbatch's ring
(``clip_loss(..., group=...)``) or gathers the representations of all ranks
(``torch.distributed.nn.functional.all_gather`` keeps the gradient path; its backward sums the
ranks' identical losses' gradients, i.e. world x, which DDP's averaging divides back) and computes
the contrastive loss over the global batch.
Every parameter gradient must equal a single-process step over the whole batch (same dropout
masks: each rank's chunks run from a per-rank seed that the reference replays), and the
gradients must be all-reduced exactly once per cached step (counted with a DDP comm hook).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed_harness import run_gloo

B_LOCAL, CHUNK, D_IN = 6, 2, 5


class Wrap(nn.Module):
    """A per-input wrapper around a shared DDP model (GradCache finds the DDP module inside)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, 12), nn.Dropout(0.3), nn.LayerNorm(12), nn.Linear(12, 6)).double()


def _data(world: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(world * B_LOCAL, D_IN, generator=g, dtype=torch.float64), \
        torch.randn(world * B_LOCAL, D_IN, generator=g, dtype=torch.float64)


def _worker(rank: int, world: int):
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_gather
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bigbatch
    from bigbatch.gradcache import GradCache, cached

    x, y = _data(world)
    xs, ys = x[rank * B_LOCAL:(rank + 1) * B_LOCAL], y[rank * B_LOCAL:(rank + 1) * B_LOCAL]
    losses = {
        # gather-with-grad: all_gather's backward sums the ranks' (identical) loss gradients
        "gather": lambda q, p: bigbatch.clip_loss(torch.cat(all_gather(q)), torch.cat(all_gather(p)), 4.0),
        # bigbatch's ring over the process group: the full multi-level system
        "ring": lambda q, p: bigbatch.clip_loss(q, p, 4.0, group=dist.group.WORLD),
    }
    out = {}
    for name, loss_fn in losses.items():
        model = DDP(_encoder(), bucket_cap_mb=1000)  # one bucket: one all-reduce per synced backward
        calls = [0]

        def counting_hook(state, bucket, calls=calls):
            calls[0] += 1
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0] / world)

        model.register_comm_hook(None, counting_hook)
        gc = GradCache([model], chunk_sizes=CHUNK, loss_fn=loss_fn)
        counts = []
        for step in range(2):  # two steps: gradients accumulate, one all-reduce each
            torch.manual_seed(100 * step + rank)
            calls[0] = 0
            gc(xs, ys)
            counts.append(calls[0])
        out[name] = (counts, [p.grad.clone() for p in model.module.parameters()])

    # the autograd-native form inside a DDP training step: the caller's backward re-runs the chunks
    from bigbatch.gradcache import cached_encode

    model = DDP(_encoder(), bucket_cap_mb=1000)
    calls = [0]

    def counting_hook2(state, bucket):
        calls[0] += 1
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0] / world)

    model.register_comm_hook(None, counting_hook2)
    counts = []
    for step in range(2):
        torch.manual_seed(100 * step + rank)
        calls[0] = 0
        q = cached_encode(model, xs, CHUNK)
        p = cached_encode(model, ys, CHUNK)
        losses["ring"](q, p).backward()
        counts.append(calls[0])
    out["cached_encode"] = (counts, [p.grad.clone() for p in model.module.parameters()])

    try:  # a static-graph DDP module is refused with the reason
        GradCache(DDP(_encoder(), static_graph=True), chunk_sizes=CHUNK, loss_fn=losses["gather"])
        static_error = None
    except ValueError as exc:
        static_error = str(exc)

    fsdp_error = None
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sharded = _encoder()
        built_before = GradCache(sharded, chunk_sizes=CHUNK, loss_fn=losses["gather"])
        fully_shard(sharded, mesh=init_device_mesh("cpu", (world,)))  # converts the module in place
        errors = []
        x, y = _data(world)
        sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
        for refused in (lambda: GradCache(sharded, chunk_sizes=CHUNK, loss_fn=losses["gather"]),
                        lambda: built_before(x[sl], y[sl]),  # sharded after the GradCache was built
                        lambda: cached(lambda m, t: m(t))(sharded, x[sl])):  # the functional API
            try:
                refused()
                errors.append(None)
            except NotImplementedError as exc:
                errors.append(str(exc))
        fsdp_error = errors[0] if all(e is not None for e in errors) else f"not refused: {errors}"
    except (ImportError, RuntimeError, ValueError) as exc:  # FSDP2 unavailable on this build/device
        fsdp_error = f"unavailable: {exc}"
    return out, fsdp_error, static_error


def _single_process_reference(world: int):
    import bigbatch
    from bigbatch.gradcache.chunking import split_batch

    model = _encoder()
    x, y = _data(world)
    for step in range(2):
        reps_q, reps_p = [], []
        for rank in range(world):  # rank r's chunks from rank r's seed, as in the DDP run
            torch.manual_seed(100 * step + rank)
            sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
            reps_q += [model(c) for c in split_batch(x[sl], CHUNK)]
            reps_p += [model(c) for c in split_batch(y[sl], CHUNK)]
        bigbatch.clip_loss(torch.cat(reps_q), torch.cat(reps_p), 4.0).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_ddp_two_ranks_equals_full_batch_one_allreduce_per_step():
    world = 2
    results = run_gloo(_worker, world)
    ref = _single_process_reference(world)
    for rank, (out, fsdp_error, static_error) in enumerate(results):
        assert static_error is not None and "static_graph=False" in static_error
        for name, (counts, grads) in out.items():
            # GradCache: one all-reduce per step; cached_encode: one per call (two calls here), each in
            # its node's last re-run chunk -- exact in any backward order since averaging is linear
            expected = [2, 2] if name == "cached_encode" else [1, 1]
            assert counts == expected, f"rank {rank}, {name}: all-reduces per step {counts}, expected {expected}"
            for i, (g, r) in enumerate(zip(grads, ref)):
                err = ((g - r).norm() / r.norm()).item()
                assert err <= 1e-10, f"rank {rank}, {name} loss, parameter {i}: relative error {err:.3e}"
        if fsdp_error is None or fsdp_error.startswith("unavailable"):
            pytest.fail(f"could not build an FSDP model to check the refusal: {fsdp_error}")
        assert not fsdp_error.startswith("not refused"), fsdp_error
        assert "FSDP" in fsdp_error and "DistributedDataParallel" in fsdp_error


def _uneven_worker(rank: int, world: int):
    """Two DDP encoders, local batches of 4 and 8 rows, chunks of 4: rank 0 runs one chunk per
    input, rank 1 two. Three steps (DDP rebuilds its buckets, a collective, in the second)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bigbatch

    x, y = _data(world)
    rows = [4, 8][rank]
    start = [0, 4][rank]
    xs, ys = x[start:start + rows], y[start:start + rows]
    out = {}
    for layout in ("two_models", "wrapped_shared"):
        torch.manual_seed(0)
        q = DDP(nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 4)).double(), bucket_cap_mb=1000)
        if layout == "two_models":
            torch.manual_seed(1)
            p = DDP(nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 4)).double(), bucket_cap_mb=1000)
            models, ddps = [q, p], [q, p]
        else:
            models, ddps = [Wrap(q), Wrap(q)], [q]
        calls = [0]

        def hook(state, bucket, calls=calls):
            calls[0] += 1
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0] / world)

        for d in ddps:
            d.register_comm_hook(None, hook)
        gc = bigbatch.GradCache(models, chunk_sizes=4,
                                loss_fn=lambda a, b: bigbatch.clip_loss(a, b, 4.0, group=dist.group.WORLD))
        for _ in range(3):
            for d in ddps:
                d.zero_grad(set_to_none=True)
            calls[0] = 0
            gc(xs, ys)
        out[layout] = ([t.grad.clone() for d in ddps for t in d.parameters()], calls[0])
    return out


def test_uneven_batches_and_wrapped_ddp_models_do_not_hang():
    """A kept pass-1 graph ran a forward with grad before the loss's collectives on the rank that
    had two chunks only, so DDP's bucket rebuild (a collective) came in a different order on the
    two ranks: the second step hung. And a DDP model inside a per-input wrapper ran no chunk under
    no_sync: one all-reduce per chunk, a different number per rank with uneven batches."""
    results = run_gloo(_uneven_worker, 2, timeout=180.0)
    x, y = _data(2)
    for layout in ("two_models", "wrapped_shared"):
        import bigbatch

        torch.manual_seed(0)
        q = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        torch.manual_seed(1)
        p = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        models = [q, p] if layout == "two_models" else [q]
        # the global batch is the ranks' shards in order (4 + 8 rows); DDP averages over 2 ranks,
        # and the ring's per-rank loss is 2 x its share: the averaged gradient is the global one
        bigbatch.clip_loss(q(x[:12]), (p if layout == "two_models" else q)(y[:12]), 4.0).backward()
        want = [t.grad for m in models for t in m.parameters()]
        for grads, calls in (r[layout] for r in results):
            assert calls == 2  # one per model: two DDP models, or two wrappers of one (not one per chunk)
            for g, w in zip(grads, want):
                assert (g - w).norm() <= 1e-10 * w.norm(), layout


class _ClipWithScale(nn.Module):  # a CLIP-style model: the loss's logit_scale lives in the DDP module
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        self.logit_scale = nn.Parameter(torch.tensor(1.3, dtype=torch.float64))

    def forward(self, x):
        return self.enc(x)


def _loss_param_worker(rank: int, world: int):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bigbatch

    x, y = _data(world)
    xs, ys = x[rank * B_LOCAL:(rank + 1) * B_LOCAL], y[rank * B_LOCAL:(rank + 1) * B_LOCAL]
    out = {}
    for find_unused in (False, True):
        m = DDP(_ClipWithScale(), find_unused_parameters=find_unused)
        gc = bigbatch.GradCache(m, chunk_sizes=2, loss_fn=lambda q, p: bigbatch.clip_loss(
            q, p, m.module.logit_scale.exp(), group=dist.group.WORLD))
        try:
            gc(xs, ys)
            out[find_unused] = [p.grad.clone() for p in m.module.parameters()]
        except ValueError as exc:
            out[find_unused] = str(exc)
        dist.barrier()
    return out


def test_loss_parameter_inside_a_ddp_encoder():
    """DDP arms its reducer for the synced re-run forward's parameters only: a logit_scale inside
    the DDP module was never all-reduced (step 1 unsynchronised, nothing reduced at all with one
    bucket; step 2 raised DDP's error). Refused with the fix named; exact with
    find_unused_parameters=True."""
    import bigbatch

    results = run_gloo(_loss_param_worker, 2, timeout=120.0)
    for r in results:
        assert "uses parameters of a DDP-wrapped encoder (logit_scale)" in r[False], r[False]
    ref = _ClipWithScale()
    x, y = _data(2)
    bigbatch.clip_loss(ref(x), ref(y), ref.logit_scale.exp()).backward()
    for r in results:
        for g, p in zip(r[True], ref.parameters()):
            assert (g - p.grad).norm() <= 1e-10 * p.grad.norm()


def _every_chunk_worker(rank: int, world: int):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bigbatch

    x, y = _data(world)
    out = {}
    for rows in ((5, 7), (6, 6)):  # uneven local batches: 3 vs 4 chunks of 2; even: 3 and 3
        lo = sum(rows[:rank])
        xs, ys = x[lo:lo + rows[rank]], y[lo:lo + rows[rank]]
        q, p = DDP(_encoder()), DDP(_encoder())
        gc = bigbatch.GradCache([q, p], chunk_sizes=CHUNK, ddp_sync="every_chunk",
                                loss_fn=lambda a, b: bigbatch.clip_loss(a, b, 3.0, group=dist.group.WORLD))
        try:
            gc(xs, ys)
            out[rows] = "ok"
        except ValueError as exc:
            out[rows] = str(exc)
    return out


def test_every_chunk_sync_with_uneven_chunk_counts_is_an_error_not_a_hang():
    """ddp_sync="every_chunk" (the public no_sync_except_last=False) all-reduces per re-run chunk:
    ranks with different chunk counts hung in different collectives. All ranks now raise."""
    for r in run_gloo(_every_chunk_worker, 2, timeout=120.0):
        assert 'ddp_sync="every_chunk"' in r[(5, 7)] and "3 to 4" in r[(5, 7)], r
        assert r[(6, 6)] == "ok", r


def _probe_worker(rank: int, world: int):
    """A per-input wrapper around a DDP model, chunks planned from a memory budget, local batches of
    9 and 20 rows: the ranks probe different row counts (one probe point or two)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bigbatch

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(29, D_IN, generator=g, dtype=torch.float64), torch.randn(29, D_IN, generator=g, dtype=torch.float64)
    rows = slice(0, 9) if rank == 0 else slice(9, 29)
    loss = lambda a, b: bigbatch.clip_loss(a, b, 3.0, group=dist.group.WORLD)  # noqa: E731
    out = {}
    for api in ("gradcache", "cached_encode"):
        torch.manual_seed(0)
        q = DDP(nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 4)).double())
        if api == "gradcache":  # a user's own instance forward calling DDP's: bypassed in the probe too
            original = q.forward
            q.forward = lambda v: original(v)
        gc = bigbatch.GradCache([Wrap(q), Wrap(q)], loss_fn=loss, memory_budget="6KB")
        for _ in range(2):  # the second step: DDP's bucket rebuild
            q.zero_grad(set_to_none=True)
            if api == "gradcache":
                gc(x[rows], y[rows])
            else:
                m = Wrap(q)
                loss(bigbatch.cached_encode(m, x[rows], memory_budget="6KB"),
                     bigbatch.cached_encode(m, y[rows], memory_budget="6KB")).backward()
        out[api] = [t.grad.clone() for t in q.parameters()]
    return out


def test_budget_probe_inside_a_wrapped_ddp_model_issues_no_collective():
    """The memory probe ran the wrapped DDP module's own forward (the top-level unwrapping missed
    it): its collectives, on the ranks and as many times as each rank probed, paired with other
    ranks' step collectives: a hang (or mismatched data). The probe now bypasses every DDP forward."""
    results = run_gloo(_probe_worker, 2, timeout=180.0)
    import bigbatch

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(29, D_IN, generator=g, dtype=torch.float64), torch.randn(29, D_IN, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    q = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    bigbatch.clip_loss(q(x), q(y), 3.0).backward()
    for r in results:
        for api in ("gradcache", "cached_encode"):
            for got, want in zip(r[api], (t.grad for t in q.parameters())):
                assert (got - want).norm() <= 1e-10 * want.norm(), api


def _wrapped_ddp_edges(rank: int, world: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bigbatch

    out = {}
    loss = lambda a, b: bigbatch.clip_loss(a, b, 2.0)  # noqa: E731
    x = torch.randn(10, D_IN, dtype=torch.float64)
    static = DDP(nn.Linear(D_IN, 3).double(), static_graph=True)
    try:
        bigbatch.GradCache([Wrap(static), Wrap(static)], chunk_sizes=4, loss_fn=loss)(x, x)
        out["static"] = "no error"
    except ValueError as exc:
        out["static"] = str(exc)
    q = DDP(nn.Linear(D_IN, 3).double())
    original = q.forward
    calls = []

    def mine(v):  # a user's own instance forward (instrumentation)
        calls.append(1)
        return original(v)

    q.forward = mine
    xs = torch.randn(9 if rank == 0 else 20, D_IN, dtype=torch.float64)  # the ranks probe different rows
    bigbatch.GradCache([Wrap(q), Wrap(q)], loss_fn=loss, memory_budget="4KB")(xs, xs)
    out["forward_kept"] = q.__dict__.get("forward") is mine
    n = len(calls)
    q(x)
    out["called"] = len(calls) > n
    return out


def test_wrapped_ddp_static_graph_refused_and_a_user_forward_kept():
    """static_graph=True inside a per-input wrapper gets the clear refusal (before: PyTorch's
    internal reducer assert); the memory probe's DDP bypass restores a forward the user had set
    on the DDP instance (before: deleted, so the class forward ran from then on), and bypasses it
    during the probe too (a user forward calling DDP's would run collectives on some ranks only)."""
    for r in run_gloo(_wrapped_ddp_edges, 2, timeout=120.0):
        assert "static_graph=False" in r["static"]
        assert r["forward_kept"] and r["called"]


def _plain_forward_worker(rank: int, world: int):
    """cached_encode and a plain forward of the same DDP module feeding one backward."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bigbatch

    torch.set_num_threads(1)
    x, y = _data(world)
    sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    xs, ys = x[sl], y[sl]
    clip = lambda a, b: bigbatch.clip_loss(a, b, 2.0, group=dist.group.WORLD)
    out = {}
    both = lambda model: clip(bigbatch.cached_encode(model, xs, chunk_size=CHUNK),
                              bigbatch.cached_encode(model, ys, chunk_size=CHUNK)).backward()
    for mode in ("cached_first", "plain_first", "both_cached", "no_grad_eval", "plain_backpropagated_first",
                 "fixed_after_refusal", "input_gradient_of_the_plain_forward"):
        model = DDP(_encoder())
        steps = []
        for step in range(2):
            try:
                if mode == "fixed_after_refusal":
                    if step == 0:
                        clip(bigbatch.cached_encode(model, xs, chunk_size=CHUNK), model(ys)).backward()
                    else:
                        both(model)
                elif mode == "input_gradient_of_the_plain_forward":  # reaches the output, reduces nothing
                    y_in = ys.clone().requires_grad_()
                    b = model(y_in)
                    (gy,) = torch.autograd.grad(b.sum(), y_in, create_graph=True)
                    (clip(bigbatch.cached_encode(model, xs, chunk_size=CHUNK), b) + gy.pow(2).mean()).backward()
                elif mode == "cached_first":
                    clip(bigbatch.cached_encode(model, xs, chunk_size=CHUNK), model(ys)).backward()
                elif mode == "plain_first":
                    b = model(ys)
                    clip(bigbatch.cached_encode(model, xs, chunk_size=CHUNK), b).backward()
                elif mode == "both_cached":
                    clip(bigbatch.cached_encode(model, xs, chunk_size=CHUNK),
                         bigbatch.cached_encode(model, ys, chunk_size=CHUNK)).backward()
                elif mode == "no_grad_eval":
                    with torch.no_grad():
                        model(ys)
                    clip(bigbatch.cached_encode(model, xs, chunk_size=CHUNK),
                         bigbatch.cached_encode(model, ys, chunk_size=CHUNK)).backward()
                else:  # an auxiliary loss back-propagated on its own first: its reduction is done
                    model(ys).pow(2).mean().backward()
                    clip(bigbatch.cached_encode(model, xs, chunk_size=CHUNK),
                         bigbatch.cached_encode(model, ys, chunk_size=CHUNK)).backward()
                steps.append("ok")
            except RuntimeError as exc:
                steps.append("refused" if "plain forward of the same DDP module" in str(exc) else str(exc)[:300])
            dist.barrier()
        out[mode] = steps
    return out


def test_cached_encode_refuses_a_pending_plain_forward_of_the_same_ddp_module():
    """DDP reduces one synced forward per backward: a cached re-run's synced forward would leave a
    plain forward's gradients of the same module unsynchronised (47% off, replicas drifting apart,
    before: no error). Watched from the first cached_encode call on the module: a plain forward
    before it in the very first step is the one case not seen (docs/gradcache.md, Limits). Every
    rank refuses together (one rank alone would leave the others in the re-run's all-reduce)."""
    for rank_out in run_gloo(_plain_forward_worker, 2, timeout=240.0):
        assert rank_out == {"cached_first": ["refused", "refused"], "plain_first": ["ok", "refused"],
                            "both_cached": ["ok", "ok"], "no_grad_eval": ["ok", "ok"],
                            "plain_backpropagated_first": ["ok", "ok"], "fixed_after_refusal": ["refused", "ok"],
                            # the plain forward before the first cached_encode call: step 1 not seen
                            "input_gradient_of_the_plain_forward": ["ok", "refused"]}, rank_out


def _rewrapped_worker(rank: int, world: int):
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    import bigbatch
    from bigbatch.gradcache.accumulate import GradAccumulation

    torch.set_num_threads(1)
    model = _encoder()
    fused_before = GradAccumulation(model).fused
    for _ in range(3):  # e.g. re-wrapped after unfreezing layers
        wrapper = DDP(model)
        bigbatch.cached_encode(wrapper, _data(world)[0][:4], chunk_size=CHUNK).sum().backward()
        del wrapper
        gc.collect()
    hooks = len(model[0].weight._post_accumulate_grad_hooks)
    return fused_before, GradAccumulation(model).fused, hooks


def test_the_ddp_watch_leaves_one_hook_per_parameter_and_the_fused_accumulation():
    """The watch's post-accumulate hook is installed once per parameter (not once per DDP wrapper
    it ever had) and does not switch off the fused accumulation of the bare module."""
    for fused_before, fused_after, hooks in run_gloo(_rewrapped_worker, 2, timeout=120.0):
        assert fused_before and fused_after and hooks == 1, (fused_before, fused_after, hooks)
