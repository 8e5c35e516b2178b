"""Small-batch A/B of the Triton CLIP loss (forward + backward) against inf-cl, in one process.

At B = 8192 a step takes a few ms, so kernel-variant differences and the inf-cl ratio are
measured side by side with many repeats (CUDA-event medians).

    python experiments/clip_small_b_ab.py --out results/clip_small_b_ab.json
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
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {
        "default": {}, "col_ref0": {"col_ref": 0}, "programs2": {"programs": 2 * sms},
        "programs4": {"programs": 4 * sms}, "programs1": {"programs": sms},
    }
    res = {"hardware": hardware(), "rows": []}
    if _infcl_available():
        _init_single_rank_group()
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for d in (512, 768):
            for b in args.batch:
                g = torch.Generator(device="cuda").manual_seed(b + d)
                q = torch.nn.functional.normalize(torch.randn(b, d, device="cuda", generator=g), dim=1).to(dtype).requires_grad_()
                k = torch.nn.functional.normalize(torch.randn(b, d, device="cuda", generator=g), dim=1).to(dtype).requires_grad_()
                logit = torch.tensor(math.log(1 / 0.07), device="cuda", requires_grad=True)
                row = {"dtype": dname, "B": b, "D": d}
                fns = {name: (lambda be=TritonTiles(tune=t): bigbatch.clip_loss(q, k, logit.exp(), backend=be)) for name, t in variants.items()}
                if dname == "fp32" and _infcl_available():
                    fns["infcl"] = lambda: _infcl(q, k, logit.exp())
                for name, fn in fns.items():
                    def step(fn=fn):
                        q.grad = k.grad = logit.grad = None
                        fn().backward()
                    row[name + "_ms"] = statistics.median(cuda_time_ms(step, warmup=3, repeat=25))
                print(row, flush=True)
                res["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
