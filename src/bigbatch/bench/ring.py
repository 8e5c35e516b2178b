"""Multi-GPU benchmark of the CLIP loss over a global batch sharded across ranks (torchrun).

    torchrun --nproc-per-node=2 -m bigbatch.bench.ring                 # -> benchmarks/results/ring_h200x2.json
    torchrun --nproc-per-node=2 -m bigbatch.bench.ring --batches 65536 --peers ring gather

One process per GPU, NCCL. In one run:
1. the bf16 matmul rate of every GPU and the ring's point-to-point bandwidth (one block shift);
2. a correctness check: the ring (auto/triton and torch tiles; bf16 and fp32; uneven shards)
   against the float64 single-process reference on the same global batch, loss and every
   gradient (local features, scale) under DDP-style averaging;
3. per global B (D=512, bf16 features): per-rank median time of forward+backward (CUDA
   events; warm-up; the slowest rank is the ring's time), per-rank peak memory above the
   inputs and their gradients, for the peers side by side:
   ``ring`` (bigbatch, backend auto), ``gather`` (OpenCLIP-style gather-with-grad, local rows
   x global columns; skipped when its b_local x B logits cannot fit), ``infcl`` (inf-cl 1.2.1's
   ring, fp32 inputs, when importable), and ``single`` (bigbatch on ONE GPU, rank 0, the whole
   global batch: the baseline of the scaling efficiency t(1 GPU, B) / (n * t(n GPUs, B))).
Rank 0 prints progress and writes the JSON (hardware named).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .common import cuda_time_ms, hardware, matmul_tflops, measure, output_path, positive_int, wall_time_ms, write_json

PEERS = ("ring", "gather", "infcl", "single", "compute")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# OpenCLIP-style gather: live fp32 (b_local x B) matrices in forward+backward, calibrated on
# The peers' published anchors (65,536 on 2 GPUs -> 32 GiB): used only to skip cases that cannot fit.
_GATHER_BXB_COPIES = 4
_LOGIT_SCALE = math.log(1 / 0.07)


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _measure(fn: Callable[[], Any], device, *, warmup: int, repeat: int) -> Dict[str, Any]:
    """common.measure on CUDA; wall-clock without memory on the CPU (smoke runs only)."""
    if device.type == "cuda":
        return measure(fn, warmup=warmup, repeat=repeat)
    times = wall_time_ms(fn, warmup=warmup, repeat=repeat)
    return {"status": "ok", "median_ms": statistics.median(times), "times_ms": times, "extra_gib": None}


def _time_ms(fn: Callable[[], Any], device, *, warmup: int, repeat: int) -> float:
    timer = cuda_time_ms if device.type == "cuda" else wall_time_ms
    return statistics.median(timer(fn, warmup=warmup, repeat=repeat))


def _unit(b: int, d: int, dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, d, generator=g, device=device, dtype=torch.float32)
    return torch.nn.functional.normalize(x, dim=1).to(dtype)


def _resolve(name: str, device) -> Any:
    """The tile backend ``name`` resolves to here; a missing Triton backend falls back, said so."""
    from bigbatch.backends import resolve_backend

    try:
        return resolve_backend(name, device)
    except (ImportError, ValueError) as exc:
        if name != "auto":
            raise
        from bigbatch.backends import TorchTiles

        _log(f"backend auto unavailable ({exc}); using torch tiles")
        return TorchTiles()


# --------------------------------------------------------------------------- correctness
def _check(device, rank: int, world: int, dtype: torch.dtype, backend, sizes: List[int], d: int) -> Dict[str, Any]:
    """Ring loss/grads vs the float64 single-process reference on the same global batch."""
    import bigbatch
    from bigbatch import reference

    total = sum(sizes)
    img = _unit(total, d, torch.float32, 11, device)
    txt = _unit(total, d, torch.float32, 12, device)
    ls = torch.tensor(_LOGIT_SCALE, dtype=torch.float64, device=device, requires_grad=True)
    ri, rt = img.double().requires_grad_(), txt.double().requires_grad_()
    ref = reference.clip_loss(ri, rt, ls.exp())
    ref.backward()
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    li = img[sl].to(dtype).requires_grad_()
    lt = txt[sl].to(dtype).requires_grad_()
    lls = torch.tensor(_LOGIT_SCALE, dtype=torch.float32, device=device, requires_grad=True)
    loss = bigbatch.clip_loss(li, lt, lls.exp(), group=dist.group.WORLD, backend=backend)
    loss.backward()

    mean_loss = loss.detach().double().clone()
    dist.all_reduce(mean_loss)
    g_ls = lls.grad.detach().double().clone()
    dist.all_reduce(g_ls)
    # squared error and reference norms summed over all shards -> global relative errors
    sq = lambda x: float((x.double() ** 2).sum())  # noqa: E731
    errs = torch.tensor(
        [sq(li.grad.double() / world - ri.grad[sl]), sq(ri.grad[sl]),
         sq(lt.grad.double() / world - rt.grad[sl]), sq(rt.grad[sl])],
        dtype=torch.float64, device=device,
    )
    dist.all_reduce(errs)
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "backend": getattr(backend, "name", str(backend)),
        "shards": sizes,
        "D": d,
        "loss_rel_err": abs(mean_loss.item() / world - ref.item()) / abs(ref.item()),
        "d_image_rel_err": math.sqrt(errs[0].item() / errs[1].item()),
        "d_text_rel_err": math.sqrt(errs[2].item() / errs[3].item()),
        "d_scale_rel_err": abs(g_ls.item() / world - ls.grad.item()) / abs(ls.grad.item()),
    }


# --------------------------------------------------------------------------- peers
def _infcl_step(img, txt, ls):
    from inf_cl import cal_inf_loss

    s = ls.exp()
    loss = 0.5 * (cal_inf_loss(img, txt, scale=s) + cal_inf_loss(txt, img, scale=s))
    loss.backward()


def _compute_only(img, txt, s, backend, world: int, chunk: int) -> None:
    """The ring's per-rank backend work WITHOUT communication (diagnostic peer ``compute``).

    Same calls as :class:`bigbatch.distributed.softmax.RingSoftmax` makes: ``world`` forward
    passes over a (b_local x b_local) block, then ``world`` chunked backward passes with fp32
    accumulators; ring time minus this time is what communication and its waits cost.
    """
    from bigbatch.backends.torch_tiles import blocks

    b, d = img.shape
    ct = torch.float32
    with torch.no_grad():
        lse_row = lse_col = None
        for _ in range(world):
            r, c = backend.lse(img, txt, s, rows=True, cols=True)
            lse_row = r if lse_row is None else torch.logaddexp(lse_row, r)
            lse_col = c if lse_col is None else torch.logaddexp(lse_col, c)
        g = torch.full((b,), 0.5 / (b * world), device=img.device)
        dq = torch.zeros((b, d), dtype=ct, device=img.device)
        for _ in range(world):
            acc = []
            for cs in blocks(b, chunk):
                dk_cs = None
                for rs in blocks(b, chunk):
                    dq_c, dk_c, _ = backend.lse_grad(img[rs], txt[cs], s, lse_row[rs], lse_col[cs], g[rs], g[cs],
                                                     grad_dtype=ct)
                    dq[rs] += dq_c
                    dk_cs = dk_c if dk_cs is None else dk_cs.add_(dk_c)
                acc.append(dk_cs)


def _case(peer: str, b_global: int, d: int, dtype: torch.dtype, args, device, backend) -> Dict[str, Any]:
    import bigbatch
    from bigbatch.distributed import ring_clip_loss
    from bigbatch.distributed.softmax import grad_chunk_rows

    rank, world = dist.get_rank(), dist.get_world_size()
    b_local = b_global // world
    peer, _, chunk_arg = peer.partition("@")  # "ring@32768": the ring with that backward chunk
    chunk = int(chunk_arg) if chunk_arg else None
    row: Dict[str, Any] = {"peer": peer, "B": b_global, "D": d, "b_local": b_local,
                           "grad_chunk": chunk or grad_chunk_rows(d)}
    if peer == "infcl":
        try:
            import inf_cl  # noqa: F401
        except Exception as exc:
            return {**row, "status": f"skipped: inf_cl not importable ({type(exc).__name__}: {exc})"[:300]}
        dtype = torch.float32  # inf-cl computes in fp32 (TF32 dots) whatever it is given
    if peer == "gather":
        need = _GATHER_BXB_COPIES * b_local * b_global * 4
        cap = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 2**40
        if need > 0.8 * cap:
            return {**row, "status": f"skipped: predicted {need / 2**30:.0f} GiB of b_local x B logits "
                                     f"> 80% of {cap / 2**30:.0f} GiB"}
    rows_here = b_global if peer == "single" else b_local
    row["dtype"] = str(dtype).replace("torch.", "")
    if peer == "single" and rank != 0:
        dist.barrier()
        return {**row, "status": "ran on rank 0"}
    img = _unit(rows_here, d, dtype, 100 + rank, device).requires_grad_()
    txt = _unit(rows_here, d, dtype, 200 + rank, device).requires_grad_()
    ls = torch.tensor(_LOGIT_SCALE, dtype=torch.float32, device=device, requires_grad=True)
    grad_bytes = 2 * rows_here * d * img.element_size()

    if peer == "infcl":
        def body():
            _infcl_step(img, txt, ls)
    elif peer == "compute":
        def body():
            _compute_only(img.detach(), txt.detach(), ls.detach().exp(), backend, world, row["grad_chunk"])
    elif peer == "ring" and chunk is not None:
        def body():
            ring_clip_loss(img, txt, ls.exp(), group=dist.group.WORLD, backend=backend, grad_chunk=chunk).backward()
    else:
        group = None if peer == "single" else dist.group.WORLD
        be = "reference" if peer == "gather" else backend

        def body():
            bigbatch.clip_loss(img, txt, ls.exp(), group=group, backend=be).backward()

    def step():
        img.grad = txt.grad = ls.grad = None
        body()

    repeat = args.repeat_slow if (peer == "infcl" and b_global >= 131072) else args.repeat
    res = _measure(step, device, warmup=1, repeat=repeat)
    if peer == "single":
        dist.barrier()
    res["extra_gib_raw"] = res.pop("extra_gib", None)
    # The memory convention: extra memory is counted beyond the inputs AND their gradients (inherent).
    raw = res.get("extra_gib_raw")
    res["extra_gib"] = None if raw is None else raw - grad_bytes / 2**30
    return {**row, **res}


def _shift_bandwidth(device, b_local: int, d: int) -> Dict[str, Any]:
    """One ring shift of a (b_local x D) block, bf16 and fp32: the link the ring relies on."""
    from bigbatch.distributed import Ring

    ring = Ring.of(dist.group.WORLD)
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x = torch.randn(b_local, d, device=device).to(dt)
        y = torch.empty_like(x)
        ms = _time_ms(lambda: ring.shift([x], [y]).wait(), device, warmup=2, repeat=5)
        out[name] = {"bytes": x.numel() * x.element_size(), "median_ms": ms,
                     "GB_per_s": x.numel() * x.element_size() / (ms * 1e-3) / 1e9}
    return out


def _summary(rows: List[Dict[str, Any]], world: int, rate: Optional[float]) -> Dict[str, Any]:
    """Per global B: the ring (default backward chunk; the median over repeated measurements of
    it, if the peer list names it more than once) against the single GPU, inf-cl and gather."""
    from bigbatch.distributed.softmax import grad_chunk_rows

    out: Dict[str, Any] = {}
    for b in sorted({r["B"] for r in rows}):
        ok = [r for r in rows if r["B"] == b and r.get("status") == "ok"]

        def get(peer):
            for r in ok:
                if r["peer"] == peer:
                    return r
            return None

        single, infcl, gather = get("single"), get("infcl"), get("gather")
        rings = [r for r in ok if r["peer"] == "ring" and r["grad_chunk"] == grad_chunk_rows(r["D"])]
        s: Dict[str, Any] = {}
        if rings:
            ring_ms = statistics.median(r["median_ms"] for r in rings)
            d = rings[0]["D"]
            s["ring_ms"] = ring_ms
            s["ring_ms_each_measurement"] = [r["median_ms"] for r in rings]
            mems = [r["extra_gib"] for r in rings if r.get("extra_gib") is not None]
            s["ring_extra_gib"] = max(mems) if mems else None  # None: not measured (the CPU smoke run)
            s["ring_effective_tflops_per_gpu"] = 8.0 * b * b * d / world / (ring_ms * 1e-3) / 1e12
            s["ring_pct_of_bf16_matmul"] = 100 * s["ring_effective_tflops_per_gpu"] / rate if rate else None
            variants = {str(r["grad_chunk"]): r["median_ms"] for r in ok if r["peer"] == "ring"}
            if len(variants) > 1:
                s["ring_ms_by_grad_chunk"] = variants
            compute = get("compute")
            if compute:
                s["compute_only_ms"] = compute["median_ms"]
                s["comm_and_wait_share"] = 1.0 - compute["median_ms"] / ring_ms
            if single:
                s["single_gpu_ms"] = single["median_ms"]
                s["scaling_efficiency"] = single["median_ms"] / (world * ring_ms)
            if infcl:
                s["infcl_ms"] = infcl["median_ms"]
                s["speedup_vs_infcl"] = infcl["median_ms"] / ring_ms
            if gather:
                s["gather_ms"] = gather["median_ms"]
                s["speedup_vs_gather"] = gather["median_ms"] / ring_ms
        out[str(b)] = s
    return out


BATCHES = [65536, 131072, 262144]


def merge_ranks(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One row for a case every rank timed: the ring is as slow as its slowest rank, so the row
    carries that rank's median and its times (so ``median_ms`` is the median of ``times_ms``), the
    largest memory of any rank, and every rank's own figures under ``per_rank``."""
    merged = dict(per_rank[0])
    oks = [x for x in per_rank if x.get("status") == "ok"]
    if len(oks) == len(per_rank):
        slowest = max(oks, key=lambda x: x["median_ms"])
        merged["median_ms"], merged["times_ms"] = slowest["median_ms"], slowest["times_ms"]
        mems = [x.get("extra_gib") for x in oks if x.get("extra_gib") is not None]
        merged["extra_gib"] = max(mems) if mems else None
    else:  # a case some rank did not complete is not a ring measurement: that rank's status and error
        i, bad = next((i, x) for i, x in enumerate(per_rank) if x.get("status") != "ok")
        for key in ("median_ms", "times_ms", "extra_gib"):
            merged.pop(key, None)
        merged["status"] = bad.get("status", "failed")
        merged["error"] = f"rank {i}: {bad.get('error', bad.get('reason', merged['status']))}"
    merged["per_rank"] = [{k: x.get(k) for k in ("status", "median_ms", "times_ms", "extra_gib", "extra_gib_raw")}
                          for x in per_rank]
    return merged


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=positive_int, nargs="+", default=BATCHES, help="global batch sizes (--cpu-smoke: 1024 2048)")
    p.add_argument("--dim", type=positive_int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--peers", nargs="+", default=["ring", "single", "infcl", "gather"],
                   help=f"among {PEERS}; 'ring@N' / 'compute@N' use N rows per backward chunk")
    p.add_argument("--backend", default="auto", help="tile backend of the ring and the single-GPU baseline")
    p.add_argument("--repeat", type=positive_int, default=3)
    p.add_argument("--repeat-slow", type=positive_int, default=1, help="repeats of inf-cl at B >= 131072")
    p.add_argument("--warm-s", type=float, default=0.0,
                   help="run the ring this many seconds before measuring (GPU clocks settle; run 2 of "
                        "ring_h200x2 saw the same ring at 588 ms cold and 486 ms warm)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--cpu-smoke", action="store_true", help="run on CPUs with gloo (B 1024 and 2048 unless --batches; a smoke test; JSON in the temporary directory)")
    p.add_argument("--check-batch", type=positive_int, default=8192, help="global batch of the correctness check")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ring_h200x<n>.json for the "
                   "default grid on GPUs, else a temporary file)")
    args = p.parse_args(argv)
    for peer in args.peers:
        if peer.partition("@")[0] not in PEERS:
            p.error(f"unknown peer {peer!r}; choose among {PEERS}")

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("bigbatch.bench.ring runs under torchrun: torchrun --nproc_per_node=N -m bigbatch.bench.ring ...",
              file=sys.stderr)
        return 2
    if args.cpu_smoke and args.batches == BATCHES:  # tiny sizes unless asked otherwise
        args.batches = [1024, 2048]
    world_env = int(os.environ["WORLD_SIZE"])
    if not args.no_check and args.check_batch < 4 * world_env:  # each rank's uneven check shard must hold rows
        p.error(f"--check-batch {args.check_batch} is too small for {world_env} processes (at least {4 * world_env})")
    not_divisible = [b for b in args.batches if b % world_env]
    if not_divisible:  # each rank takes B / world rows: the ring would measure fewer rows than the baseline
        p.error(f"--batches {not_divisible} not divisible by the number of processes ({world_env})")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and not args.cpu_smoke:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=device)
    elif args.cpu_smoke:  # gloo on the CPU: checks that the script runs, numbers mean nothing
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    else:
        print("bigbatch.bench.ring needs CUDA GPUs (run it with torchrun, one process per GPU)", file=sys.stderr)
        return 2
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[args.dtype]
    backend = _resolve(args.backend, device)
    _log(f"{world} ranks, backend {getattr(backend, 'name', backend)}, batches {args.batches}, D {args.dim}")

    rate = matmul_tflops(torch.bfloat16) if device.type == "cuda" else None  # not measured on the CPU
    rates = [None] * world
    dist.all_gather_object(rates, rate)
    _log(f"bf16 matmul TFLOP/s per rank: {[None if r is None else round(r) for r in rates]}")
    payload: Dict[str, Any] = {
        "benchmark": "ring", "world_size": world, "hardware": hardware(), "dtype": args.dtype, "D": args.dim,
        "backend": getattr(backend, "name", str(backend)), "matmul_bf16_tflops_per_rank": rates,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
    }
    shift_b = max(args.batches) // world
    payload["shift"] = _shift_bandwidth(device, shift_b, args.dim)
    _log(f"ring shift of {shift_b}x{args.dim}: {payload['shift']}")

    if not args.no_check:
        from bigbatch.backends import TorchTiles

        checks = []
        b_chk = args.check_batch
        skew = b_chk // (4 * world)  # shards of different sizes: rank 0 gets more, rank 1 fewer
        uneven = [b_chk // world + (skew if r == 0 else -skew if r == 1 else 0) for r in range(world)]
        uneven[-1] += b_chk - sum(uneven)
        for dt, be in ((torch.bfloat16, backend), (torch.float32, backend), (torch.bfloat16, TorchTiles())):
            c = _check(device, rank, world, dt, be, uneven, args.dim)
            tol = 5e-3 if dt == torch.float32 else 3e-2  # TF32 dots / bf16 operands, vs float64
            c["tolerance"] = tol
            c["ok"] = all(c[key] <= tol for key in c if key.endswith("_rel_err"))
            checks.append(c)
            _log(f"check {c}")
        payload["checks"] = checks

    gpu = torch.cuda.get_device_name(0).split()[-1].lower() if device.type == "cuda" else "cpu"
    # a CPU smoke run, or another grid than the committed run's, never lands in the repo
    out_path = output_path(p, args, os.path.join("benchmarks", "results", f"ring_{gpu}x{world}.json"),
                           f"ring_{gpu}x{world}.json", ["batches", "dim", "dtype", "peers", "backend"],
                           canonical=device.type == "cuda") if rank == 0 else ""
    if args.warm_s > 0:
        import bigbatch

        b_local = args.batches[0] // world
        img = _unit(b_local, args.dim, dtype, 1, device).requires_grad_()
        txt = _unit(b_local, args.dim, dtype, 2, device).requires_grad_()
        t_end, n_warm = time.time() + args.warm_s, 0
        while True:  # every rank runs the same number of steps: rank 0 decides when to stop
            bigbatch.clip_loss(img, txt, 10.0, group=dist.group.WORLD, backend=backend).backward()
            n_warm += 1
            stop = torch.tensor([float(time.time() > t_end)], device=device)
            dist.broadcast(stop, 0)
            if stop.item():
                break
        payload["warm_up"] = {"seconds": args.warm_s, "ring_steps": n_warm, "B": args.batches[0]}
        _log(f"warm-up: {n_warm} ring steps")
        del img, txt
    rows: List[Dict[str, Any]] = []
    for b in args.batches:
        for peer in args.peers:
            t0 = time.time()
            r = _case(peer, b, args.dim, dtype, args, device, backend)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, r)
            merged = dict(per_rank[0]) if peer == "single" else merge_ranks(per_rank)
            rows.append(merged)
            if rank == 0:  # partial results survive a time-out
                write_json(out_path + ".partial", {**payload, "rows": rows})
            _log(f"B={b} {peer}: {merged.get('status')} {merged.get('median_ms')} ms, extra {merged.get('extra_gib')} GiB "
                 f"({time.time() - t0:.1f} s)")
            torch.cuda.empty_cache()
    payload["rows"] = rows
    payload["summary"] = _summary(rows, world, min(rates) if None not in rates else None)
    if rank == 0:
        write_json(out_path, payload)
        if os.path.exists(out_path + ".partial"):
            os.remove(out_path + ".partial")
        _log(f"wrote {out_path}")
        for b, s in payload["summary"].items():
            print(b, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
