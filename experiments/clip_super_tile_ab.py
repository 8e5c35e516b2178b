"""A/B of the backward's dS super-tile for bf16 features (one H200 visit).

Session 14's profile of a B = 32,768 step found ~10.1 ms of kernels in 11-21 ms steps: the
backward issues three launches per 4096 x 4096 super-tile from Python (~0.1 ms of GPU work each at
D = 512), so the GPU waits between them. Larger super-tiles mean fewer launches (and larger cuBLAS
products) for more workspace (bf16 dS: 32 MiB at 4096 x 4096, 128 MiB at 8192 x 8192). Variants
are interleaved over rounds (CUDA-event medians); the peak memory above the inputs is recorded.

    python experiments/clip_super_tile_ab.py --out /tmp/clip_super_tile_ab.json
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

import bigbatch
from bigbatch.backends.triton_softmax import TritonTiles
from bigbatch.bench.common import cuda_time_ms, hardware, write_json

VARIANTS = {"4096x4096": (4096, 4096), "8192x4096": (8192, 4096), "4096x8192": (4096, 8192),
            "8192x8192": (8192, 8192), "16384x8192": (16384, 8192)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="+", default=["8192x512", "32768x512", "65536x512", "262144x512",
                                                   "32768x128", "65536x128", "32768x768"])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rows = []
    for case in args.cases:
        b, d = map(int, case.split("x"))
        g = torch.Generator(device="cuda").manual_seed(b + d)
        q = torch.nn.functional.normalize(torch.randn(b, d, device="cuda", generator=g), dim=1).bfloat16().requires_grad_()
        k = torch.nn.functional.normalize(torch.randn(b, d, device="cuda", generator=g), dim=1).bfloat16().requires_grad_()
        logit = torch.tensor(math.log(1 / 0.07), device="cuda", requires_grad=True)
        times = {v: [] for v in VARIANTS}
        peak = {}
        repeat = 5 if b <= 65536 else 2
        for _ in range(args.rounds):
            for name, st in VARIANTS.items():
                be = TritonTiles(super_tile=st)

                def step():
                    q.grad = k.grad = logit.grad = None
                    bigbatch.clip_loss(q, k, logit.exp(), backend=be).backward()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                times[name] += cuda_time_ms(step, warmup=1, repeat=repeat)
                peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row = {"batch": b, "dim": d, "median_ms": {v: statistics.median(t) for v, t in times.items()},
               "min_ms": {v: min(t) for v, t in times.items()}, "peak_extra_mib": peak}
        rows.append(row)
        print(case, {v: round(m, 2) for v, m in row["median_ms"].items()}, {v: round(m) for v, m in peak.items()}, flush=True)
        del q, k
        torch.cuda.empty_cache()
    write_json(args.out, {"hardware": hardware(), "rows": rows})


if __name__ == "__main__":
    main()
