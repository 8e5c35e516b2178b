"""Single-GPU benchmark of the symmetric CLIP loss, forward + backward, side by side.

Peers in one process on the same random unit-norm inputs: the naive full matrix
(OpenCLIP-style: ``logits = s * q @ k.T``, cross-entropy both ways, autograd), inf-cl 1.2.1
when importable (two ``cal_inf_loss`` calls; fp32 inputs; a 1-rank NCCL group is created
because it needs ``torch.distributed``), bigbatch's torch tiles, and bigbatch's Triton kernels.
The bf16 and TF32 matmul rates are measured first, in the same run. Per case: median time
(CUDA events), peak memory above the inputs, effective TFLOP/s = 8*B^2*D / time and its
percentage of the measured bf16 rate. Out-of-memory is a result; cases whose estimated time
exceeds ``--max-est-s`` are recorded as skipped with the estimate.

    python -m bigbatch.bench.clip                       # the issue's grid -> benchmarks/results/clip_h200.{json,png}
    python -m bigbatch.bench.clip --batch 8192 32768 --dims 512 --dtypes bf16 --impls naive triton
    python -m bigbatch.bench.clip --tune                # block-shape sweep of the Triton kernels
    python -m bigbatch.bench.clip --ab                  # time the kernel variants first, run the grid with the fastest
    python -m bigbatch.bench.clip --replot benchmarks/results/clip_h200.json   # redraw the PNG (no GPU)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .common import cuda_time_ms, hardware, matmul_tflops, measure, output_path, write_json

IMPLS = ("naive", "infcl", "torch", "triton")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Rough rates (TFLOP/s in 8*B^2*D terms) used only to skip cases that would run too long.
_EST_TFLOPS = {
    ("naive", "bf16"): 90, ("naive", "fp16"): 90, ("naive", "fp32"): 60,
    ("infcl", "fp32"): 18,
    ("torch", "bf16"): 60, ("torch", "fp16"): 60, ("torch", "fp32"): 30,
    ("triton", "bf16"): 250, ("triton", "fp16"): 250, ("triton", "fp32"): 60,
}


def flops(b: int, d: int) -> float:
    """Forward (2) + backward (6) matrix work of the CLIP loss: 8*B^2*D."""
    return 8.0 * b * b * d


def _naive(q, k, s):
    logits = s * (q @ k.t())
    labels = torch.arange(q.shape[0], device=q.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels))


_INFCL_ERROR: List[str] = []


def _infcl_available() -> bool:
    try:
        import inf_cl  # noqa: F401
    except Exception as exc:  # recorded in the skip reason
        _INFCL_ERROR[:] = [f"{type(exc).__name__}: {exc}"[:200]]
        return False
    return True


def _init_single_rank_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)


def _infcl(q, k, s):
    from inf_cl import cal_inf_loss

    return 0.5 * (cal_inf_loss(q, k, scale=s) + cal_inf_loss(k, q, scale=s))


def _loss_fn(impl: str, precision: str, tune: Optional[Dict[str, int]] = None) -> Callable:
    import bigbatch
    from bigbatch.backends.triton_softmax import TritonTiles

    if impl == "naive":
        return _naive
    if impl == "infcl":
        return _infcl
    if impl == "torch":
        return lambda q, k, s: bigbatch.clip_loss(q, k, s, backend="torch")
    if impl == "triton":
        be = TritonTiles(precision=precision, tune=tune or None)
        return lambda q, k, s: bigbatch.clip_loss(q, k, s, backend=be)
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")


def _inputs(b: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(2):
        x = torch.randn(b, d, device="cuda", dtype=torch.float32, generator=g)
        x = torch.nn.functional.normalize(x, dim=1).to(dtype)
        out.append(x.requires_grad_(True))
    logit = torch.tensor(math.log(1 / 0.07), device="cuda", requires_grad=True)
    return out[0], out[1], logit


def run_case(impl: str, b: int, d: int, dname: str, args, rate_bf16: float) -> Dict[str, Any]:
    dtype = DTYPES[dname]
    row: Dict[str, Any] = {"impl": impl, "B": b, "D": d, "dtype": dname, "flops": flops(b, d)}
    if impl == "infcl":
        if not _infcl_available():
            return {**row, "status": f"skipped: inf_cl not importable ({_INFCL_ERROR[0] if _INFCL_ERROR else '?'})"}
        if dtype != torch.float32:
            return {**row, "status": "skipped: inf-cl takes fp32 inputs only"}
    est = flops(b, d) / (_EST_TFLOPS.get((impl, dname), 50) * 1e12)
    row["est_s"] = est
    if est > args.max_est_s:
        return {**row, "status": f"skipped: est. {est:.0f} s > {args.max_est_s:.0f} s"}
    if impl == "infcl":
        _init_single_rank_group()
    q, k, logit = _inputs(b, d, dtype, seed=b + d)
    tune = args.triton_tune.get("fp32" if dtype == torch.float32 else "half") if impl == "triton" else None
    fn = _loss_fn(impl, args.precision, tune)
    if tune:
        row["triton_tune"] = tune

    def step():
        q.grad = k.grad = logit.grad = None
        loss = fn(q, k, logit.exp())
        loss.backward()
        return loss

    # Cases of a few seconds get fewer repeats; a 1 s case still gets 5 (its spread is ~10%).
    warmup, repeat = (0, 1) if est > 5 else ((1, 3) if est > 2.5 else (args.warmup, args.repeat))
    try:
        res = measure(step, warmup=warmup, repeat=repeat)
    except RuntimeError as exc:  # e.g. a cuBLAS/triton failure at sizes past int32 indexing
        res = {"status": f"error: {str(exc).splitlines()[0][:200]}"}
    finally:
        q.grad = k.grad = logit.grad = None
    row.update(res)
    row["input_gib"] = 2 * b * d * q.element_size() / 2**30
    if res.get("status") == "ok":
        tf = flops(b, d) / (res["median_ms"] * 1e-3) / 1e12
        row["tflops"] = tf
        row["pct_bf16_matmul"] = 100.0 * tf / rate_bf16
    del q, k, logit
    return row


def _summary(rows: List[Dict[str, Any]], rate_bf16: float) -> Dict[str, Any]:
    """The issue's targets, read off the results."""
    def get(impl, b, d, dt):
        for r in rows:
            if (r["impl"], r["B"], r["D"], r["dtype"]) == (impl, b, d, dt) and r.get("status") == "ok":
                return r
        return None

    out: Dict[str, Any] = {}
    t = get("triton", 262144, 512, "bf16")
    inf = get("infcl", 262144, 512, "fp32")
    if t:
        budget = 2 * t["input_gib"] + 64 / 1024
        out["B262144_D512_bf16"] = {
            "triton_ms": t["median_ms"],
            "pct_bf16_matmul": t["pct_bf16_matmul"],
            "target_pct": 50.0,
            "extra_gib": t["extra_gib"],
            "extra_budget_gib": budget,
            "speedup_vs_infcl_fp32": (inf["median_ms"] / t["median_ms"]) if inf else None,
        }
    t1m = get("triton", 1048576, 512, "bf16")
    if t1m:
        out["B1048576_D512_bf16_s"] = t1m["median_ms"] / 1e3
    speed32 = {}
    for r in rows:
        if r["impl"] == "triton" and r["dtype"] == "fp32" and r.get("status") == "ok":
            i = get("infcl", r["B"], r["D"], "fp32")
            if i:
                speed32[f"B{r['B']}_D{r['D']}"] = i["median_ms"] / r["median_ms"]
    out["fp32_speedup_vs_infcl"] = speed32
    vs_naive = {}
    for r in rows:
        if r["impl"] == "triton" and r.get("status") == "ok":
            n = get("naive", r["B"], r["D"], r["dtype"])
            if n:
                vs_naive[f"{r['dtype']}_B{r['B']}_D{r['D']}"] = n["median_ms"] / r["median_ms"]
    out["speedup_vs_naive"] = vs_naive
    return out


def plot(payload: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["results"]
    combos = sorted({(r["dtype"], r["D"]) for r in rows})
    ncols = min(2, len(combos))
    nrows = -(-len(combos) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
    colors = {"naive": "tab:blue", "infcl": "tab:orange", "torch": "tab:green", "triton": "tab:red"}
    for ax in axes.flat[len(combos):]:
        ax.set_visible(False)
    for ax, (dt, d) in zip(axes.flat, combos):
        for impl in IMPLS:
            pts = sorted((r["B"], r["tflops"]) for r in rows
                         if r["impl"] == impl and r["dtype"] == dt and r["D"] == d and "tflops" in r)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl, color=colors[impl])
        ax.axhline(payload["matmul_tflops"]["bf16"], color="gray", ls="--", lw=0.8, label="bf16 matmul")
        ax.axhline(0.5 * payload["matmul_tflops"]["bf16"], color="gray", ls=":", lw=0.8, label="50% bf16")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch B")
        ax.set_ylabel("TFLOP/s (8*B^2*D / time)")
        ax.set_title(f"CLIP loss fwd+bwd, {dt}, D={d}")
        ax.legend(fontsize=7)
    fig.suptitle(payload["hardware"].get("gpu", "?"))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------ tuning
def _tune(args) -> Dict[str, Any]:
    """Time the Triton kernels under several block shapes (forward pass, backward pass)."""
    from bigbatch.backends.triton_softmax import TritonTiles

    out: Dict[str, Any] = {"hardware": hardware(), "fwd": [], "bwd": [], "mm_vs_cublas": {}}
    b, d = args.tune_batch, 512
    fwd_cfgs = [
        dict(block_m=128, block_n=128, block_d=64, warps=8, stages=3),
        dict(block_m=128, block_n=128, block_d=64, warps=4, stages=3),
        dict(block_m=128, block_n=64, block_d=64, warps=4, stages=3),
        dict(block_m=128, block_n=256, block_d=64, warps=8, stages=3),
        dict(block_m=256, block_n=128, block_d=64, warps=8, stages=3),
        dict(block_m=128, block_n=128, block_d=128, warps=8, stages=2),
        dict(block_m=64, block_n=128, block_d=64, warps=4, stages=4),
    ]
    mm_cfgs = [
        dict(mm_block_m=128, mm_block_n=128, mm_block_k=64, mm_warps=8, mm_stages=4),
        dict(mm_block_m=128, mm_block_n=256, mm_block_k=64, mm_warps=8, mm_stages=3),
        dict(mm_block_m=128, mm_block_n=128, mm_block_k=64, mm_warps=4, mm_stages=4),
        dict(mm_block_m=256, mm_block_n=128, mm_block_k=64, mm_warps=8, mm_stages=3),
        dict(mm_block_m=128, mm_block_n=64, mm_block_k=64, mm_warps=4, mm_stages=4),
    ]
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        q, k, _ = _inputs(b, d, dtype, seed=1)
        q, k = q.detach(), k.detach()
        s = torch.tensor(14.0, device="cuda")
        for cfg in fwd_cfgs:
            if dtype == torch.float32 and cfg["block_d"] > 64:
                continue
            if dtype == torch.float32:
                cfg = {**cfg, "block_d": 32}
            be = TritonTiles(precision=args.precision, tune=cfg)
            try:
                ms = statistics.median(cuda_time_ms(lambda: be.lse(q, k, s, rows=True, cols=True), warmup=2, repeat=5))
                lr, lc = be.lse(q, k, s, rows=True, cols=True)
                g = torch.full_like(lr, 0.5 / b)
                bms = statistics.median(
                    cuda_time_ms(lambda: be.lse_grad(q, k, s, lr, lc, g, g), warmup=1, repeat=3)
                )
                row = {"dtype": dname, **cfg, "fwd_ms": ms, "fwd_tflops": 2 * b * b * d / ms / 1e9,
                       "bwd_ms": bms, "bwd_tflops": 6 * b * b * d / bms / 1e9}
            except Exception as exc:  # a config that does not compile is a result of the sweep
                row = {"dtype": dname, **cfg, "error": str(exc).splitlines()[0][:200]}
            print("fwd/bwd", row, flush=True)
            out["fwd"].append(row)
        ok = [r for r in out["fwd"] if r["dtype"] == dname and "fwd_ms" in r]
        best = min(ok, key=lambda r: r["bwd_ms"]) if ok else fwd_cfgs[0]
        tile = {key: best[key] for key in ("block_m", "block_n", "block_d", "warps", "stages")}
        lr, lc = TritonTiles(precision=args.precision, tune=tile).lse(q, k, s, rows=True, cols=True)
        g = torch.full_like(lr, 0.5 / b)
        for cfg in mm_cfgs:
            if dtype == torch.float32:
                cfg = {**cfg, "mm_block_k": 32, "mm_stages": 3}
            be = TritonTiles(precision=args.precision, tune={**tile, **cfg})
            try:
                bms = statistics.median(
                    cuda_time_ms(lambda: be.lse_grad(q, k, s, lr, lc, g, g), warmup=1, repeat=3)
                )
                row = {"dtype": dname, **tile, **cfg, "bwd_ms": bms, "bwd_tflops": 6 * b * b * d / bms / 1e9}
            except Exception as exc:
                row = {"dtype": dname, **cfg, "error": str(exc).splitlines()[0][:200]}
            print("mm", row, flush=True)
            out["bwd"].append(row)
        # Our fp32-accumulating matmul against cuBLAS on one super-tile product.
        a = torch.randn(4096, 4096, device="cuda", dtype=dtype)
        bm = torch.randn(4096, d, device="cuda", dtype=dtype)
        ms_cublas = statistics.median(cuda_time_ms(lambda: a @ bm, warmup=3, repeat=20))
        out["mm_vs_cublas"][dname] = {"cublas_ms": ms_cublas, "cublas_tflops": 2 * 4096 * 4096 * d / ms_cublas / 1e9}
        print("cublas 4096x4096x512", out["mm_vs_cublas"][dname], flush=True)
        del q, k
        torch.cuda.empty_cache()
    return out


def _check_vs_float64(tune: Dict[str, int], dtype: torch.dtype, precision: str) -> Dict[str, float]:
    """Relative errors of loss and gradients of one variant against float64 (B=4096, D=512)."""
    import bigbatch
    from bigbatch import reference
    from bigbatch.backends.triton_softmax import TritonTiles

    q, k, logit = _inputs(4096, 512, dtype, seed=3)
    loss = bigbatch.clip_loss(q, k, logit.exp(), backend=TritonTiles(precision=precision, tune=tune))
    loss.backward()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    l64 = logit.detach().double().requires_grad_()
    ref = reference.clip_loss(q64, k64, l64.exp())
    ref.backward()

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    return {"loss": rel(loss.detach(), ref.detach()), "dq": rel(q.grad, q64.grad),
            "dk": rel(k.grad, k64.grad), "dscale": rel(logit.grad, l64.grad)}


def _ab(args) -> Dict[str, Any]:
    """Pick the kernel variant per dtype family from timings in this run (forward at B=262144,
    backward at B=65536, D=512); a variant that fails its float64 check is not eligible."""
    from bigbatch.backends.triton_softmax import TritonTiles

    fams = {"half": torch.bfloat16, "fp32": torch.float32}
    fwd_vars = [{}, {"col_ref": 0}, {"one_exp": 1}]
    bwd_vars = {"half": [{}, {"ds_one_exp": 1}], "fp32": [{}, {"kmajor": 0}, {"ds_one_exp": 1}]}
    out: Dict[str, Any] = {"fwd": [], "bwd": [], "chosen": {}}
    for fam, dtype in fams.items():
        tol = 1e-2 if fam == "half" else 2e-3
        s = torch.tensor(1 / 0.07, device="cuda")
        best_f, best_b = None, None
        bf = 262144 if fam == "half" else 65536
        q, k, _ = _inputs(bf, 512, dtype, seed=5)
        q, k = q.detach(), k.detach()
        for v in fwd_vars:
            row: Dict[str, Any] = {"family": fam, "tune": v, "B": bf}
            try:
                row["check"] = _check_vs_float64(v, dtype, args.precision)
                ok = max(row["check"].values()) <= tol
                be = TritonTiles(precision=args.precision, tune=v)
                row["fwd_ms"] = statistics.median(cuda_time_ms(lambda: be.lse(q, k, s, rows=True, cols=True), warmup=1, repeat=3))
                row["fwd_tflops"] = 2 * bf * bf * 512 / row["fwd_ms"] / 1e9
                if ok and (best_f is None or row["fwd_ms"] < best_f[1]):
                    best_f = (v, row["fwd_ms"])
            except Exception as exc:  # a variant that does not compile or run is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print("A/B fwd", row, flush=True)
            out["fwd"].append(row)
        del q, k
        bb = 65536 if fam == "half" else 32768
        q, k, _ = _inputs(bb, 512, dtype, seed=6)
        q, k = q.detach(), k.detach()
        fwd_tune = best_f[0] if best_f else {}
        lr, lc = TritonTiles(precision=args.precision, tune=fwd_tune).lse(q, k, s, rows=True, cols=True)
        g = torch.full_like(lr, 0.5 / bb)
        for v in bwd_vars[fam]:
            tune = {**fwd_tune, **v}
            row = {"family": fam, "tune": tune, "B": bb}
            try:
                row["check"] = _check_vs_float64(tune, dtype, args.precision)
                ok = max(row["check"].values()) <= tol
                be = TritonTiles(precision=args.precision, tune=tune)
                row["bwd_ms"] = statistics.median(cuda_time_ms(lambda: be.lse_grad(q, k, s, lr, lc, g, g), warmup=1, repeat=3))
                row["bwd_tflops"] = 6 * bb * bb * 512 / row["bwd_ms"] / 1e9
                if ok and (best_b is None or row["bwd_ms"] < best_b[1]):
                    best_b = (tune, row["bwd_ms"])
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            print("A/B bwd", row, flush=True)
            out["bwd"].append(row)
        del q, k, lr, lc, g
        torch.cuda.empty_cache()
        out["chosen"][fam] = best_b[0] if best_b else fwd_tune
        print(f"A/B chosen for {fam}: {out['chosen'][fam]}", flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bigbatch.bench.clip", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8192, 32768, 65536, 262144, 1048576])
    p.add_argument("--dims", type=int, nargs="+", default=[512, 768])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--precision", default="tf32", choices=("tf32", "ieee"), help="triton's fp32 dot precision")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--max-est-s", type=float, default=30.0, help="skip cases estimated to take longer per call")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/clip_h200.json for the default grid, else a temporary file)")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--tune", action="store_true", help="sweep the Triton kernels' block shapes instead")
    p.add_argument("--tune-batch", type=int, default=32768)
    p.add_argument("--ab", action="store_true",
                   help="first time the kernel variants (checked against float64) and run the grid with the fastest")
    p.add_argument("--replot", metavar="JSON", default=None, help="only redraw the PNG of an earlier run's JSON")
    args = p.parse_args(argv)
    args.triton_tune = {}
    if args.replot:
        import json

        with open(args.replot) as fh:
            payload = json.load(fh)
        png = args.plot or os.path.splitext(args.replot)[0] + ".png"
        plot(payload, png)
        print(f"wrote {png}")
        return 0
    if not torch.cuda.is_available():
        print("bigbatch.bench.clip needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out = output_path(p, args, "benchmarks/results/clip_h200.json", "clip_tune.json" if args.tune else "clip.json",
                           ["batch", "dims", "dtypes", "impls", "precision", "max_est_s", "tune", "ab"])
    if args.tune:
        write_json(args.out, _tune(args))
        print(f"wrote {args.out}")
        return 0
    t0 = time.time()
    rate_bf16 = matmul_tflops(torch.bfloat16)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    rate_tf32 = matmul_tflops(torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = prev
    print(f"matmul rate: bf16 {rate_bf16:.0f} TFLOP/s, tf32 {rate_tf32:.0f} TFLOP/s", flush=True)
    payload: Dict[str, Any] = {
        "benchmark": "clip loss forward+backward, one GPU",
        "hardware": hardware(),
        "matmul_tflops": {"bf16": rate_bf16, "tf32": rate_tf32},
        "flops_formula": "8*B^2*D",
        "args": vars(args),
        "fp32_matmul_allow_tf32_for_peers": prev,
        "results": [],
    }
    if args.ab and "triton" in args.impls:
        payload["ab"] = _ab(args)
        args.triton_tune = payload["ab"]["chosen"]
        payload["args"] = vars(args)
        write_json(args.out, payload)
    rows = payload["results"]
    for dname in args.dtypes:
        for d in args.dims:
            for b in sorted(args.batch):
                for impl in args.impls:
                    row = run_case(impl, b, d, dname, args, rate_bf16)
                    rows.append(row)
                    msg = row.get("status")
                    if msg == "ok":
                        msg = (f"{row['median_ms']:10.1f} ms {row['extra_gib']:7.2f} GiB "
                               f"{row['tflops']:6.1f} TFLOP/s ({row['pct_bf16_matmul']:4.1f}%)")
                    print(f"[{time.time() - t0:6.0f}s] {dname} D={d:4d} B={b:8d} {impl:7s} {msg}", flush=True)
                    payload["summary"] = _summary(rows, rate_bf16)
                    write_json(args.out, payload)
    png = args.plot or os.path.splitext(args.out)[0] + ".png"
    try:
        plot(payload, png)
        print(f"wrote {png}")
    except ImportError as exc:
        print(f"no plot: {exc}")
    print("summary:", payload["summary"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
