"""Small-batch A/B of the Triton CLIP loss (forward + backward) against inf-cl, in one process.

At B = 8192 a step takes a few ms, so kernel-variant differences and the inf-cl ratio are
measured side by side with many repeats (CUDA-event medians).

    python experiments/clip_small_b_ab.py --out /tmp/clip_small_b_ab.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

import bigbatch
from bigbatch.backends.triton_softmax import TritonTiles
from bigbatch.bench.clip import _infcl, _infcl_available, _init_single_rank_group
from bigbatch.bench.common import cuda_time_ms, hardware


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--dims", type=int, nargs="+", default=[512, 768])
    p.add_argument("--set", default="v1", choices=("v1", "fp32"))
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {
        "default": {}, "col_ref0": {"col_ref": 0}, "programs2": {"programs": 2 * sms},
        "programs4": {"programs": 4 * sms}, "programs1": {"programs": sms},
    }
    if args.set == "fp32":  # fewer, larger super-tiles and one launch for both products
        variants = {
            "default": {}, "pair": {"products": "pair"}, "st4096": {"super_rows": 4096, "super_cols": 4096},
            "pair_st4096": {"products": "pair", "super_rows": 4096, "super_cols": 4096},
        }
    res = {"hardware": hardware(), "args": vars(args), "rows": []}
    if _infcl_available():
        _init_single_rank_group()
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if dname not in args.dtypes:
            continue
        for d in args.dims:
            for b in args.batch:
                g = torch.Generator(device="cuda").manual_seed(b + d)
                q = torch.nn.functional.normalize(torch.randn(b, d, device="cuda", generator=g), dim=1).to(dtype).requires_grad_()
                k = torch.nn.functional.normalize(torch.randn(b, d, device="cuda", generator=g), dim=1).to(dtype).requires_grad_()
                logit = torch.tensor(math.log(1 / 0.07), device="cuda", requires_grad=True)
                row = {"dtype": dname, "B": b, "D": d}
                fns = {name: (lambda be=TritonTiles(tune=t): bigbatch.clip_loss(q, k, logit.exp(), backend=be)) for name, t in variants.items()}
                if dname == "fp32" and _infcl_available() and b <= 65536:
                    fns["infcl"] = lambda: _infcl(q, k, logit.exp())
                for name, fn in fns.items():
                    def step(fn=fn):
                        q.grad = k.grad = logit.grad = None
                        fn().backward()
                    reps = 25 if b <= 65536 else 3
                    row[name + "_ms"] = statistics.median(cuda_time_ms(step, warmup=min(3, reps), repeat=reps))
                print(row, flush=True)
                res["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
