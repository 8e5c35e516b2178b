"""Where does the Triton CLIP loss spend its time on a GPU? A/B of kernel variants in one process.

Forward (``lse``, both directions): block shapes, programs per SM, rows-only / columns-only,
and a "dots only" copy of the forward loop whose epilogue is one row max per tile: the
ceiling that the tile loop itself (loads + MMAs) allows, with no softmax statistics.
Backward (``lse_grad``): the two gradient products as two Triton launches, one paired launch,
or cuBLAS, for several super-tile shapes and product block shapes.
Every variant is checked against float64 at a small B before it is timed.

    python experiments/clip_kernel_probe.py --out /tmp/clip_kernel_probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import triton
import triton.language as tl

from bigbatch.backends.triton_softmax import TritonTiles, _split
from bigbatch.backends.triton_softmax_fwd import _tile_logits2
from bigbatch.bench.common import cuda_time_ms, hardware, matmul_tflops


@triton.jit
def dots_only_kernel(q_ptr, k_ptr, scale_ptr, out_ptr, B, N, D, stride_q, stride_k, rpg, cpg,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT: tl.constexpr):
    rg = tl.program_id(0)
    cg = tl.program_id(1)
    scale2 = tl.load(scale_ptr).to(tl.float32)
    rb_end = tl.minimum(rg * rpg + rpg, tl.cdiv(B, BLOCK_M))
    cb_end = tl.minimum(cg * cpg + cpg, tl.cdiv(N, BLOCK_N))
    for rb in range(rg * rpg, rb_end):
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < B
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        for cb in range(cg * cpg, cb_end):
            cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
            s2 = _tile_logits2(q_ptr, k_ptr, rows, cols, rmask, cols < N, D, stride_q, stride_k, scale2,
                               BLOCK_M, BLOCK_N, BLOCK_D, DOT, "tf32" if DOT == tl.bfloat16 else "ieee", False)
            m = tl.maximum(m, tl.max(s2, axis=1))
        tl.store(out_ptr + cg.to(tl.int64) * B + rows, m, mask=rmask)


def dots_only(q, k, scale, bm, bn, bd, warps, stages, programs):
    b, n = q.shape[0], k.shape[0]
    rpg, rg = _split(triton.cdiv(b, bm), max(1, math.isqrt(programs)))
    cpg, cg = _split(triton.cdiv(n, bn), max(1, programs // rg))
    out = torch.empty((cg, b), device=q.device)
    dots_only_kernel[(rg, cg)](q, k, scale, out, b, n, q.shape[1], q.stride(0), k.stride(0), rpg, cpg,
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, DOT=tl.bfloat16 if q.is_cuda else tl.float32, num_warps=warps, num_stages=stages)
    return out


def ref64(q, k, scale):
    s = scale * q.double() @ k.double().t()
    lr, lc = torch.logsumexp(s, 1), torch.logsumexp(s, 0)
    g_r = torch.full_like(lr, 0.5 / q.shape[0])
    g_c = torch.full_like(lc, 0.5 / k.shape[0])
    ds = g_r[:, None] * torch.exp(s - lr[:, None]) + g_c[None, :] * torch.exp(s - lc[None, :])
    return lr, lc, g_r, g_c, scale * ds @ k.double(), scale * ds.t() @ q.double()


def rel(x, r):
    return ((x.double() - r).norm() / r.norm()).item()


def med(fn, repeat):
    return statistics.median(cuda_time_ms(fn, warmup=1, repeat=repeat))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--b", type=int, default=131072)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--set", default="v1", choices=("v1", "v2"))
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    res = {"hardware": hardware(), "args": vars(args), "fwd": [], "bwd": [], "check": []}
    res["bf16_matmul_tflops"] = mm = matmul_tflops()
    print(f"matmul {mm:.0f} TFLOP/s", flush=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    fwd_cfgs = [
        dict(block_m=128, block_n=128, block_d=64, warps=4, stages=3, programs=2 * sms),
        dict(block_m=128, block_n=128, block_d=64, warps=4, stages=4, programs=2 * sms),
        dict(block_m=128, block_n=128, block_d=64, warps=4, stages=3, programs=sms),
        dict(block_m=128, block_n=128, block_d=64, warps=4, stages=3, programs=4 * sms),
        dict(block_m=128, block_n=256, block_d=64, warps=8, stages=3, programs=sms),
        dict(block_m=256, block_n=128, block_d=64, warps=8, stages=3, programs=sms),
        dict(block_m=64, block_n=256, block_d=64, warps=4, stages=3, programs=2 * sms),
        dict(block_m=128, block_n=128, block_d=32, warps=4, stages=5, programs=2 * sms),
    ]
    bwd_cfgs = [
        dict(products="separate"),
        dict(products="cublas"),
        dict(products="pair"),
        dict(products="pair", mm_block_m=128, mm_block_n=128, mm_block_k=64, mm_warps=4, mm_stages=3),
        dict(products="pair", mm_block_m=128, mm_block_n=128, mm_block_k=64, mm_warps=8, mm_stages=3),
        dict(products="pair", mm_block_m=128, mm_block_n=256, mm_block_k=64, mm_warps=8, mm_stages=3),
        dict(products="cublas", super_rows=2048, super_cols=8192),
        dict(products="cublas", super_rows=8192, super_cols=2048),
        dict(products="pair", super_rows=2048, super_cols=8192),
        dict(products="pair", super_rows=8192, super_cols=2048),
        dict(products="separate", super_rows=8192, super_cols=2048),
        dict(products="cublas", ds_block_n=128, ds_warps=4),
    ]
    if args.set == "v2":  # after the column-reference forward and cuBLAS products became defaults
        base = dict(block_m=128, block_n=128, block_d=64, warps=4, stages=3, programs=2 * sms)
        fwd_cfgs = [
            dict(base), dict(base, col_ref=0), dict(base, programs=4 * sms), dict(base, block_d=32, stages=5),
            dict(base, block_n=256, warps=8, programs=sms), dict(base, block_m=256, warps=8, programs=sms),
            dict(base, block_n=256, warps=8, programs=2 * sms),
        ]
        bwd_cfgs = [dict(), dict(ds_block_m=128, ds_block_n=128, ds_warps=8), dict(ds_block_m=256, ds_block_n=128, ds_warps=8)]
    if args.quick:
        fwd_cfgs, bwd_cfgs = fwd_cfgs[:2], bwd_cfgs[:3]

    # ---- correctness of every variant at a small B, against float64
    g = torch.Generator(device=dev).manual_seed(0)
    bc = 3000
    qc = torch.nn.functional.normalize(torch.randn(bc, args.d, device=dev, generator=g), dim=1).bfloat16()
    kc = torch.nn.functional.normalize(torch.randn(bc, args.d, device=dev, generator=g), dim=1).bfloat16()
    sc = torch.tensor(1 / 0.07, device=dev)
    lr64, lc64, gr64, gc64, dq64, dk64 = ref64(qc, kc, 1 / 0.07)
    for cfg in fwd_cfgs + bwd_cfgs:
        be = TritonTiles(tune=cfg, super_tile=(1024, 2048) if "super_rows" not in cfg else None)
        lr, lc = be.lse(qc, kc, sc, rows=True, cols=True)
        dq, dk, _ = be.lse_grad(qc, kc, sc, lr, lc, gr64.float(), gc64.float())
        c = {"cfg": cfg, "lse_row": rel(lr, lr64), "lse_col": rel(lc, lc64), "dq": rel(dq, dq64), "dk": rel(dk, dk64)}
        c["ok"] = max(c["lse_row"], c["lse_col"]) < 1e-3 and max(c["dq"], c["dk"]) < 1e-2
        res["check"].append(c)
        print("check", c, flush=True)
    save()

    # ---- timing at B
    b, d = args.b, args.d
    q = torch.nn.functional.normalize(torch.randn(b, d, device=dev, generator=g), dim=1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(b, d, device=dev, generator=g), dim=1).bfloat16()
    s = torch.tensor(1 / 0.07, device=dev)
    f2 = 2.0 * b * b * d
    for cfg in fwd_cfgs:
        be = TritonTiles(tune=cfg)
        row = {"cfg": cfg}
        row["both_ms"] = med(lambda: be.lse(q, k, s, rows=True, cols=True), args.repeat)
        row["rows_ms"] = med(lambda: be.lse(q, k, s, rows=True, cols=False), args.repeat)
        row["cols_ms"] = med(lambda: be.lse(q, k, s, rows=False, cols=True), args.repeat)
        row["dots_only_ms"] = med(lambda: dots_only(q, k, s, cfg["block_m"], cfg["block_n"], cfg["block_d"],
                                                    cfg["warps"], cfg["stages"], cfg["programs"]), args.repeat)
        for key in ("both", "rows", "cols", "dots_only"):
            row[key + "_pct"] = 100 * f2 / (row[key + "_ms"] * 1e9) / mm
        res["fwd"].append(row)
        print("fwd", row, flush=True)
        save()
    lr, lc = TritonTiles().lse(q, k, s, rows=True, cols=True)
    gr = torch.full_like(lr, 0.5 / b)
    gc = torch.full_like(lc, 0.5 / b)
    f6 = 6.0 * b * b * d
    for cfg in bwd_cfgs:
        be = TritonTiles(tune=cfg)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = med(lambda: be.lse_grad(q, k, s, lr, lc, gr, gc), args.repeat)
        row = {"cfg": cfg, "bwd_ms": t, "bwd_pct": 100 * f6 / (t * 1e9) / mm,
               "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
        res["bwd"].append(row)
        print("bwd", row, flush=True)
        save()
    save()


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
