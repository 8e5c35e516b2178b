"""GPU time of a Linear's bias gradient (the column sum of its incoming gradient) at the shapes of
gradient caching's chunks (one GPU, session 23).

In a cached step's chunk backward, ``AddmmBackward0`` sums the bf16 incoming gradient ``(M, N)``
over its rows for the bias; at ~32k-token chunks PyTorch's reduction kernel ran at about a third of
memory bandwidth (``probes/gradcache_idle_probe_h200.json``: 27.9 ms per 2,048 passage rows in
256-row chunks against 13.2 in one chunk). This times ways of computing the same sum, CUDA-event
medians, with the bandwidth each reaches (bytes read: ``M * N * 2``):

* ``sum0``: ``g.sum(0)`` (what autograd runs);
* ``sum0_fp32``: ``g.sum(0, dtype=torch.float32)``;
* ``gemv``: ``ones(M) @ g`` (cuBLAS; fp32 accumulation, bf16 result);
* ``two_stage``: ``g.view(S, M // S, N).sum(1).sum(0)`` for a few ``S`` (rows split so that more
  blocks share each column).

    python experiments/bias_grad_probe.py --out /tmp/bias_grad.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bigbatch.bench.common import cuda_time_ms, hardware


def gpu_ms(fn) -> float:
    return statistics.median(cuda_time_ms(fn, warmup=5, repeat=50))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[32768, 35328, 262144])
    p.add_argument("--cols", type=int, nargs="+", default=[768, 3072])
    args = p.parse_args()
    res = {"hardware": hardware(), "rows": []}
    for m in args.rows:
        for n in args.cols:
            g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            ones = torch.ones(m, device="cuda", dtype=torch.bfloat16)
            ref = g.double().sum(0)
            variants = {"sum0": lambda: g.sum(0), "sum0_fp32": lambda: g.sum(0, dtype=torch.float32),
                        "gemv": lambda: ones @ g}
            for s in (4, 16, 64):
                if m % s == 0:
                    variants[f"two_stage_{s}"] = lambda s=s: g.view(s, m // s, n).sum(1, dtype=torch.float32).sum(0)
            row = {"m": m, "n": n}
            for name, fn in variants.items():
                ms = gpu_ms(fn)
                err = ((fn().double() - ref).abs().max() / ref.abs().max()).item()
                row[name] = {"ms": ms, "gb_s": m * n * 2 / ms / 1e6, "rel_err": err}
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
