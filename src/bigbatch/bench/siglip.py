"""Benchmark of the sigmoid (SigLIP) loss, forward + backward, peers side by side.

One GPU (default): on the same random unit-norm inputs, the full-matrix sigmoid loss
(OpenCLIP-style: ``logits = s * q @ k.T + b``, ``-logsigmoid(labels * logits).sum() / B``,
autograd), bigbatch's torch tiles and bigbatch's Triton kernel. The bf16 matmul rate is
measured first, in the same run. Per case: median time (CUDA events), peak memory above the
inputs, effective TFLOP/s = 6*B^2*D / time and its percentage of the measured bf16 rate.
Out-of-memory is a result. A correctness check against float64 runs in the same process.

Several GPUs (``--ring``, under ``torchrun --nproc_per_node=N``): per local batch, bigbatch's ring
(``group=``) against OpenCLIP's neighbour-exchange formulation (written out here: each step's
text block arrives through an autograd-aware send/recv and its logits are kept for the
backward), plus bigbatch on one GPU with the same local batch (the memory yardstick).

    python -m bigbatch.bench.siglip                  # -> benchmarks/results/siglip_h200.{json,png}
    python -m bigbatch.bench.siglip --batch 8192 65536 --impls naive triton --tune
    torchrun --nproc_per_node=2 -m bigbatch.bench.siglip --ring --batch 32768 65536 131072
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from .common import cuda_time_ms, hardware, matmul_tflops, measure, output_path, positive_int, wall_time_ms, write_json

IMPLS = ("naive", "torch", "triton")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, maxnreg): a register cap of 128 with 8 warps lets two
# programs share an SM (one's epilogue overlaps the other's products); 4-warp tiles do it with less.
TUNE_CONFIGS = [(128, 128, 64, 8, 3, 0), (128, 128, 64, 8, 3, 128), (128, 64, 64, 4, 3, 0), (128, 64, 64, 4, 4, 168)]


def flops(b: int, d: int) -> float:
    """Loss + every gradient: logits (2) and the two gradient products (4): 6*B^2*D."""
    return 6.0 * b * b * d


def naive_siglip(q, k, scale, bias):
    """OpenCLIP's SigLipLoss._loss on one device (full B x B logits kept for autograd)."""
    logits = scale * (q @ k.t()) + bias
    labels = 2 * torch.eye(q.shape[0], device=q.device, dtype=q.dtype) - 1
    return -F.logsigmoid(labels * logits).sum() / q.shape[0]


def _inputs(b: int, d: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = F.normalize(torch.randn(b, d, device=device, generator=g), dim=1).to(dtype).requires_grad_()
    k = F.normalize(torch.randn(b, d, device=device, generator=g), dim=1).to(dtype).requires_grad_()
    log_scale = torch.tensor(math.log(10.0), device=device, requires_grad=True)
    bias = torch.tensor(-10.0, device=device, requires_grad=True)
    return q, k, log_scale, bias


def _loss_fn(impl: str, backend=None):
    import bigbatch

    if impl == "naive":
        return lambda q, k, s, b: naive_siglip(q, k, s, b)
    return lambda q, k, s, b: bigbatch.siglip_loss(q, k, s, b, backend=backend or impl)


def _step(fn, q, k, log_scale, bias):
    loss = fn(q, k, log_scale.exp(), bias)
    return torch.autograd.grad(loss, (q, k, log_scale, bias))


def correctness(b: int, d: int, dtype: torch.dtype, backend) -> Dict[str, float]:
    """Relative errors of loss and every gradient against float64 on the same rounded inputs."""
    from bigbatch import reference

    q, k, log_scale, bias = _inputs(b, d, dtype, "cuda", seed=1)
    loss = _loss_fn("triton", backend)(q, k, log_scale.exp(), bias)
    grads = torch.autograd.grad(loss, (q, k, log_scale, bias))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    ls64, b64 = log_scale.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    ref = reference.siglip_loss(q64, k64, ls64.exp(), b64)
    ref_g = torch.autograd.grad(ref, (q64, k64, ls64, b64))

    def rel(x, r):
        return ((x.double() - r).norm() / r.norm()).item()

    out = {"loss": rel(loss, ref)}
    for name, x, r in zip(("d_image", "d_text", "d_log_scale", "d_bias"), grads, ref_g):
        out[name] = rel(x, r)
    return out


def tune(b: int, d: int, dtype: torch.dtype) -> List[Dict[str, Any]]:
    """Time a few kernel configs (forward + backward) at one size; the fastest comes first."""
    from bigbatch.backends.triton_sigmoid import TritonSigmoid

    q, k, log_scale, bias = _inputs(b, d, dtype, "cuda")
    rows = []
    for cfg in TUNE_CONFIGS:
        fn = _loss_fn("triton", TritonSigmoid(block=cfg))
        try:
            ms = statistics.median(cuda_time_ms(lambda: _step(fn, q, k, log_scale, bias), warmup=1, repeat=3))
            rows.append({"block": list(cfg), "median_ms": ms})
        except Exception as exc:  # a config the compiler rejects (e.g. shared memory) is a result
            rows.append({"block": list(cfg), "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
        print(f"  tune {cfg}: {rows[-1]}", flush=True)
    rows.sort(key=lambda r: r.get("median_ms", math.inf))
    return rows


def single_gpu(args) -> Dict[str, Any]:
    from bigbatch.backends import gemm
    from bigbatch.backends.triton_sigmoid import TritonSigmoid

    dtype = DTYPES[args.dtype]
    bf16_rate = matmul_tflops(torch.bfloat16)
    print(f"bf16 matmul: {bf16_rate:.0f} TFLOP/s", flush=True)
    block = None
    tuned = []
    if args.tune:
        tuned = tune(args.tune_batch, args.dim, dtype)
        if "median_ms" in tuned[0]:
            block = tuple(tuned[0]["block"])
    triton_backend = TritonSigmoid(block=block)
    check = correctness(args.check_batch, args.dim, dtype, triton_backend)
    print(f"correctness vs float64 at B={args.check_batch}: {check}", flush=True)
    results = []
    for b in args.batch:
        q, k, log_scale, bias = _inputs(b, args.dim, dtype, "cuda")
        for impl in args.impls:
            if impl == "torch" and b > args.torch_max:
                results.append({"impl": impl, "batch": b, "status": "skipped", "reason": f"B > --torch-max {args.torch_max}"})
                continue
            if impl == "naive" and b > args.naive_max:
                need = 3 * b * b * q.element_size() / 2**30
                results.append({"impl": impl, "batch": b, "status": "skipped",
                                "reason": f"needs > {need:.0f} GiB of logits (B x B kept for autograd)"})
                continue
            fn = _loss_fn(impl, triton_backend if impl == "triton" else None)
            r = measure(lambda: _step(fn, q, k, log_scale, bias), warmup=1, repeat=args.repeat)
            r.update({"impl": impl, "batch": b, "dim": args.dim, "dtype": args.dtype})
            if r["status"] == "ok":
                r["tflops_6b2d"] = flops(b, args.dim) / (r["median_ms"] * 1e-3) / 1e12
                r["pct_of_bf16_matmul"] = 100.0 * r["tflops_6b2d"] / bf16_rate
            results.append(r)
            print(_row(r), flush=True)
        if "triton" in args.impls:  # the loss alone (no gradients): 2*B^2*D
            with torch.no_grad():
                fn = _loss_fn("triton", triton_backend)
                r = measure(lambda: fn(q, k, log_scale.exp(), bias), warmup=1, repeat=args.repeat)
            r.update({"impl": "triton-forward-only", "batch": b, "dim": args.dim, "dtype": args.dtype})
            if r["status"] == "ok":
                r["tflops_2b2d"] = 2.0 * b * b * args.dim / (r["median_ms"] * 1e-3) / 1e12
            results.append(r)
            print(_row(r), flush=True)
        del q, k
    return {
        "benchmark": "siglip single GPU: forward + backward (loss and all gradients)",
        "hardware": hardware(),
        "bf16_matmul_tflops": bf16_rate,
        "flops_accounting": "6*B^2*D",
        "kernel_block": list(block) if block else "default",
        "mm_acc_mode": gemm._MM_ACC_MODES.get("cuda"),
        "tune": tuned,
        "correctness_rel_err": {"batch": args.check_batch, "dtype": args.dtype, **check},
        "results": results,
    }


def _row(r: Dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['impl']:>20} B={r['batch']:>7}  {r['status']} {r.get('reason', r.get('error', ''))}"
    rate = r.get("tflops_6b2d", r.get("tflops_2b2d", 0.0))
    pct = r.get("pct_of_bf16_matmul")
    return (f"{r['impl']:>20} B={r['batch']:>7}  {r['median_ms']:9.1f} ms  {r['extra_gib']:7.2f} GiB  "
            f"{rate:6.0f} TFLOP/s" + (f"  {pct:5.1f}% of bf16 matmul" if pct is not None else ""))


# ----------------------------------------------------------------------------- several GPUs


class _NeighbourExchange(torch.autograd.Function):
    """Send ``x`` to the next rank, receive the previous rank's; gradients flow back the other way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        _exchange(x, out, to_next=True, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty_like(grad)
        _exchange(grad.contiguous(), out, to_next=False, group=ctx.group)
        return out, None


def _exchange(send, recv, *, to_next: bool, group) -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dst = dist.get_global_rank(group, (rank + (1 if to_next else -1)) % world)
    src = dist.get_global_rank(group, (rank - (1 if to_next else -1)) % world)
    ops = [dist.P2POp(dist.isend, send.contiguous(), dst, group), dist.P2POp(dist.irecv, recv, src, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def neighbour_exchange_siglip(q, k, scale, bias, group):
    """OpenCLIP's distributed SigLipLoss (unidirectional neighbour exchange), written out:
    local logits with positives, then world-1 steps of negatives-only logits against the text
    block received from the previous rank; every step's logits stay alive for autograd."""
    import torch.distributed as dist

    loss = naive_siglip(q, k, scale, bias)
    text = k
    for _ in range(dist.get_world_size(group) - 1):
        text = _NeighbourExchange.apply(text, group)
        logits = scale * (q @ text.t()) + bias
        loss = loss + (-F.logsigmoid(-logits).sum() / q.shape[0])
    return loss


class _GatherWithGrad(torch.autograd.Function):
    """All ranks' (equal) blocks concatenated; the gradient of this rank's block is the sum over
    ranks of their gradients for its rows (one all_reduce of the B x D gradient, then a slice)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def gather_full_matrix_siglip(q, k, scale, bias, group):
    """The full-matrix peer on several GPUs: all texts gathered with autograd, this rank's
    b x B logits kept for the backward (OpenCLIP's gather-with-grad, applied to the sigmoid loss).
    Equal shards; rank r's positives are columns r*b .. r*b + b - 1. Returns the same per-rank
    value as the ring (world / B * this rank's rows' terms)."""
    import torch.distributed as dist

    rank, b = dist.get_rank(group), q.shape[0]
    texts = _GatherWithGrad.apply(k, group)
    logits = scale * (q @ texts.t()) + bias
    labels = -torch.ones_like(logits)
    labels[:, rank * b:(rank + 1) * b] += 2 * torch.eye(b, device=q.device, dtype=q.dtype)
    return -F.logsigmoid(labels * logits).sum() / b  # world / B = 1 / b for equal shards


def _measure_ring_case(fn, device, warmup: int, repeat: int) -> Dict[str, Any]:
    """``measure()`` on CUDA (median time, peak extra memory above the live memory before the call);
    wall-clock times and no memory on the CPU dry run."""
    if device.type == "cuda":
        return measure(fn, warmup=warmup, repeat=repeat)
    times = wall_time_ms(fn, warmup=warmup, repeat=repeat)
    return {"status": "ok", "median_ms": statistics.median(times), "times_ms": times, "extra_gib": float("nan")}


def ring_correctness(b: int, d: int, dtype: torch.dtype, group, device) -> Dict[str, float]:
    """Ring loss and every gradient against float64 over the gathered global batch (equal shards,
    DDP-style averaging of the gradients, chunk_rows forcing several chunks per block)."""
    import torch.distributed as dist

    from bigbatch import reference
    from bigbatch.distributed.sigmoid import ring_siglip_loss

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, log_scale, bias = _inputs(b, d, dtype, device, seed=100 + rank)
    loss = ring_siglip_loss(q, k, log_scale.exp(), bias, group=group, chunk_rows=max(1, b // 3))
    grads = torch.autograd.grad(loss, (q, k, log_scale, bias))

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return parts

    q_all = torch.cat(gather(q.detach())).double().requires_grad_()
    k_all = torch.cat(gather(k.detach())).double().requires_grad_()
    ls64, b64 = log_scale.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    ref = reference.siglip_loss(q_all, k_all, ls64.exp(), b64)
    ref_g = torch.autograd.grad(ref, (q_all, k_all, ls64, b64))
    mean = lambda x: torch.stack(gather(x.detach().double().reshape(1))).mean()  # noqa: E731 - DDP averaging

    def rel(x, r):
        return ((x.double() - r).norm() / r.norm()).item()

    out = {"loss": rel(mean(loss), ref.detach())}
    out["d_image"] = rel(torch.cat(gather(grads[0])) / world, ref_g[0])
    out["d_text"] = rel(torch.cat(gather(grads[1])) / world, ref_g[1])
    out["d_log_scale"] = rel(mean(grads[2]), ref_g[2])
    out["d_bias"] = rel(mean(grads[3]), ref_g[3])
    return out


def _mm_acc_mode_name() -> Optional[str]:
    from bigbatch.backends import gemm

    return gemm._MM_ACC_MODES.get("cuda")


def ring(args) -> Optional[Dict[str, Any]]:
    import torch.distributed as dist

    import bigbatch
    from bigbatch.distributed.sigmoid import _plan_and_backend, transient_bytes
    from bigbatch.sigmoid_loss import resolve_sigmoid_backend

    if args.cpu:  # dry run of this code path (gloo, torch tiles, wall clock, no memory numbers)
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local_rank)
    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype] if not args.cpu else torch.float32
    bf16_rate = matmul_tflops(torch.bfloat16) if device.type == "cuda" else float("nan")
    if rank == 0:
        print(f"{world} ranks on {device.type}; bf16 matmul {bf16_rate:.0f} TFLOP/s", flush=True)
    check = ring_correctness(args.check_batch, args.dim, dtype, group, device)
    if rank == 0:
        print(f"ring correctness vs float64 at local B={args.check_batch}: {check}", flush=True)
    results, plans, summary = [], [], []
    impls = {
        "bigbatch-ring": lambda q, k, s, b: bigbatch.siglip_loss(q, k, s, b, group=group),
        "neighbour-exchange": lambda q, k, s, b: neighbour_exchange_siglip(q, k, s, b, group),
        "gather-full-matrix": lambda q, k, s, b: gather_full_matrix_siglip(q, k, s, b, group),
        "bigbatch-1gpu-same-local-batch": lambda q, k, s, b: bigbatch.siglip_loss(q, k, s, b),
    }
    impls_one = "bigbatch-1gpu-same-local-batch"
    for b in args.batch:
        q, k, log_scale, bias = _inputs(b, args.dim, dtype, device, seed=rank)
        # What the memory rule plans for this call (the same on every rank: equal shards).
        plan, _ = _plan_and_backend(resolve_sigmoid_backend("auto", device, dtype), [b] * world, q, None, True, None)
        one, _ = _plan_and_backend(resolve_sigmoid_backend("auto", device, dtype), [b], q, None, True, None)
        plans.append({"local_batch": b, "chunks": plan.chunks, "chunk_rows": plan.chunk_rows,
                      "slot_bytes": plan.slot_bytes, "backend_workspace": plan.backend_workspace,
                      "one_gpu_workspace": plan.workspace,
                      "planned_forward_gib": transient_bytes(b, args.dim, dtype, plan) / 2**30,
                      "planned_one_gpu_forward_gib": transient_bytes(b, args.dim, dtype, one) / 2**30})
        agreement = {}  # each peer's per-rank loss value against the ring's (same inputs)
        if b <= args.peer_max:
            with torch.no_grad():
                vals = {n: f(q, k, log_scale.exp(), bias).double() for n, f in impls.items() if n != impls_one}
            ref = vals["bigbatch-ring"]
            agreement = {n: (abs(v - ref) / abs(ref)).item() for n, v in vals.items()}
        for name, fn in impls.items():
            if name in ("neighbour-exchange", "gather-full-matrix") and b > args.peer_max:
                r = {"status": "skipped",
                     "reason": f"keeps b x b (or b x B) logits; local B > --peer-max {args.peer_max}"}
            else:
                dist.barrier()
                r = _measure_ring_case(lambda: _step(fn, q, k, log_scale, bias), device, 1, args.repeat)
                # Any rank out of memory makes the case out of memory (the others would hang next).
                flag = torch.tensor([r["status"] != "ok"], device=device, dtype=torch.int32)
                dist.all_reduce(flag)
                if flag.item() and r["status"] == "ok":
                    r = {"status": "oom", "error": "another rank ran out of memory"}
            mem = torch.tensor([r.get("extra_gib", float("nan"))], device=device, dtype=torch.float64)
            mems = [torch.empty_like(mem) for _ in range(world)]
            dist.all_gather(mems, mem)
            one_gpu = name == impls_one
            if name in agreement:
                r["loss_rel_diff_vs_ring_rank0" if rank == 0 else "loss_rel_diff_vs_ring"] = agreement[name]
            r.update({"impl": name, "local_batch": b, "global_batch": b if one_gpu else b * world,
                      "dim": args.dim, "dtype": str(dtype).replace("torch.", ""), "world": world,
                      "extra_gib_per_rank": [m.item() for m in mems]})
            if r["status"] == "ok":
                r["tflops_6b2d_total"] = flops(r["global_batch"], args.dim) / (r["median_ms"] * 1e-3) / 1e12
                r["tflops_6b2d_per_gpu"] = r["tflops_6b2d_total"] / (1 if one_gpu else world)
                r["pct_of_bf16_matmul_per_gpu"] = 100.0 * r["tflops_6b2d_per_gpu"] / bf16_rate
            results.append(r)
            if rank == 0:
                print(f"{name:>32} local B={b:>7} global={r['global_batch']:>7}  {r['status']}  "
                      f"{r.get('median_ms', float('nan')):9.1f} ms  per-rank GiB {r['extra_gib_per_rank']}", flush=True)
        ring_r, one_r = results[-len(impls)], results[-1]
        if ring_r["status"] == "ok" and one_r["status"] == "ok":
            worst = max(ring_r["extra_gib_per_rank"])
            yard = max(one_r["extra_gib_per_rank"])
            summary.append({"local_batch": b, "ring_peak_extra_gib_max_rank": worst, "one_gpu_peak_extra_gib": yard,
                            "ring_minus_one_gpu_mib": (worst - yard) * 1024,
                            # (null on the CPU dry run, which measures no memory)
                            "ring_no_larger": bool(worst <= yard) if math.isfinite(worst - yard) else None})
            if rank == 0:
                print(f"  memory, local B={b}: ring {worst:.4f} GiB vs one GPU {yard:.4f} GiB", flush=True)
        del q, k
    out = None
    if rank == 0:
        out = {
            "benchmark": f"siglip ring on {world} {'GPUs' if device.type == 'cuda' else 'CPU processes (dry run)'}: "
                         "forward + backward",
            "hardware": hardware(),
            "bf16_matmul_tflops": bf16_rate,
            "flops_accounting": "6*B^2*D (B global; per GPU: divided by the ranks)",
            "memory": "extra_gib = peak allocated above the live memory before the call (inputs), "
                      "forward + backward, per rank; NCCL's own buffers are not in the torch allocator",
            "ring_correctness_rel_err": {"local_batch": args.check_batch, **check},
            "mm_acc_mode": _mm_acc_mode_name(),
            "plans": plans,
            "memory_summary": summary,
            "results": results,
        }
    dist.destroy_process_group()
    return out


def plot(payload: Dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for impl in sorted({r["impl"] for r in payload["results"]}):
        rows = [r for r in payload["results"] if r["impl"] == impl and r["status"] == "ok"]
        if not rows:
            continue
        xs = [r["batch"] for r in rows]
        ax_t.plot(xs, [r["median_ms"] for r in rows], marker="o", label=impl)
        ax_m.plot(xs, [r["extra_gib"] for r in rows], marker="o", label=impl)
    for ax, label in ((ax_t, "time (ms), forward + backward"), (ax_m, "peak extra memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch B (D=512, bf16)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"SigLIP loss on {payload['hardware'].get('gpu', '?')} "
                 f"(bf16 matmul {payload['bf16_matmul_tflops']:.0f} TFLOP/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


# the committed runs' sizes: one GPU (global batches), the ring (local batches per GPU)
_GRID = [8192, 32768, 65536, 131072, 262144]
_RING_GRID = [32768, 65536, 131072, 262144]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=positive_int, nargs="+", default=None,
                   help="batch sizes (default 8192 .. 262144; --ring: local batches 32768 .. 262144; with --cpu: 64)")
    p.add_argument("--dim", type=positive_int, default=None, help="feature dimension (default 512; with --cpu: 16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--naive-max", type=positive_int, default=131072, help="largest B for the full-matrix peers")
    p.add_argument("--torch-max", type=positive_int, default=32768, help="largest B for the torch tiles")
    p.add_argument("--check-batch", type=positive_int, default=None,
                   help="batch of the float64 correctness check (default 8192; with --cpu: 24)")
    p.add_argument("--tune", action="store_true", help="pick the kernel block config by timing a few")
    p.add_argument("--tune-batch", type=positive_int, default=65536)
    p.add_argument("--ring", action="store_true", help="several GPUs under torchrun")
    p.add_argument("--peer-max", type=positive_int, default=65536,
                   help="--ring: largest local B for the neighbour-exchange and gather-full-matrix peers")
    p.add_argument("--cpu", action="store_true",
                   help="--ring only: a dry run of the ring path on CPU processes (gloo), tiny sizes")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/siglip_<kind>.json for the "
                   "default sizes on GPUs, else a temporary file)")
    args = p.parse_args(argv)
    # sizes not given: the committed GPU run's (one GPU, or the ring's local batches), or tiny ones for
    # the CPU dry run (the GPU sizes need tens of GiB)
    grid = _RING_GRID if args.ring else _GRID
    for name, gpu, cpu in (("batch", grid, [64]), ("dim", 512, 16), ("check_batch", 8192, 24)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if args.cpu else gpu)
    if args.cpu and not args.ring:
        print("--cpu is a dry run of --ring only", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not args.cpu:
        print("this benchmark needs a CUDA GPU (or --ring --cpu for a dry run)", file=sys.stderr)
        return 2
    if args.ring and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        print("--ring runs under torchrun: torchrun --nproc_per_node=N -m bigbatch.bench.siglip --ring ...",
              file=sys.stderr)
        return 2
    kind = f"siglip_ring_h200x{os.environ.get('WORLD_SIZE')}" if args.ring else "siglip_h200"
    out = output_path(p, args, f"benchmarks/results/{kind}.json", "siglip_ring_cpu.json" if args.cpu else f"{kind}.json",
                      ["dtype", "impls", "naive_max", "torch_max", "tune", "peer_max"],
                      canonical=not args.cpu and args.batch == grid and args.dim == 512)
    if args.ring:
        payload = ring(args)
        if payload is not None:
            write_json(out, payload)
            print(f"wrote {out}", flush=True)
        return 0
    payload = single_gpu(args)
    path = out
    write_json(path, payload)
    print(f"wrote {path}", flush=True)
    plot(payload, os.path.splitext(path)[0] + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
