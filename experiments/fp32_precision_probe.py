"""What exact fp32 costs: the fused CLIP and SigLIP losses on float32 features, forward + backward,
with exact fp32 dots (``"ieee"``, the default under torch's default matmul setting) against TF32,
next to the bf16 path and torch's own fp32 / TF32 matmul rates, in one process on one GPU.
Also the relative error of each against float64 at B = 4096 (scale 100).

    python experiments/fp32_precision_probe.py --out /tmp/fp32_precision_probe.json
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

import bigbatch
from bigbatch import reference
from bigbatch.backends.triton_sigmoid import TritonSigmoid
from bigbatch.backends.triton_softmax import TritonTiles
from bigbatch.bench.common import cuda_time_ms, hardware, matmul_tflops, write_json


def _unit(b: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, d, generator=g, device="cuda")
    return (x / x.norm(dim=1, keepdim=True)).to(dtype)


def _step(loss: str, backend, q, k, logit):
    def run():
        q.grad = k.grad = logit.grad = None
        if loss == "clip":
            out = bigbatch.clip_loss(q, k, logit.exp(), backend=backend)
        else:
            out = bigbatch.siglip_loss(q, k, logit.exp(), -10.0, backend=backend)
        out.backward()
        return out
    return run


def _error(loss: str, backend, b: int, d: int) -> float:
    q, k = _unit(b, d, torch.float32, 1).requires_grad_(), _unit(b, d, torch.float32, 2).requires_grad_()
    logit = torch.tensor(math.log(100.0), device="cuda", requires_grad=True)
    out = _step(loss, backend, q, k, logit)()
    q64, k64, l64 = (x.detach().double().requires_grad_() for x in (q, k, logit))
    ref = reference.clip_loss(q64, k64, l64.exp()) if loss == "clip" else reference.siglip_loss(q64, k64, l64.exp(), -10.0)
    ref.backward()
    pairs = [(out, ref), (q.grad, q64.grad), (k.grad, k64.grad), (logit.grad, l64.grad)]
    return max(((a.double() - r).norm() / r.norm()).item() for a, r in pairs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--dim", type=int, default=512)
    args = p.parse_args()
    out = {"hardware": hardware(), "dim": args.dim,
           "matmul_tflops": {"bf16": matmul_tflops(torch.bfloat16), "fp32_ieee": None, "tf32": None}, "rows": []}
    mm = torch.backends.cuda.matmul
    old = mm.allow_tf32
    mm.allow_tf32 = False
    out["matmul_tflops"]["fp32_ieee"] = matmul_tflops(torch.float32)
    mm.allow_tf32 = True
    out["matmul_tflops"]["tf32"] = matmul_tflops(torch.float32)
    mm.allow_tf32 = old
    variants = {
        "clip": {"fp32_ieee": (torch.float32, TritonTiles(precision="ieee")),
                 "fp32_tf32": (torch.float32, TritonTiles(precision="tf32")),
                 "bf16": (torch.bfloat16, TritonTiles())},
        "siglip": {"fp32_ieee": (torch.float32, TritonSigmoid(fp32_precision="ieee")),
                   "fp32_tf32": (torch.float32, TritonSigmoid(fp32_precision="tf32")),
                   "bf16": (torch.bfloat16, TritonSigmoid())},
    }
    for loss, vs in variants.items():
        for name, (dtype, be) in vs.items():
            err = _error(loss, be, 4096, args.dim) if dtype == torch.float32 else None
            for b in args.batch:
                q, k = _unit(b, args.dim, dtype, 3).requires_grad_(), _unit(b, args.dim, dtype, 4).requires_grad_()
                logit = torch.tensor(math.log(100.0), device="cuda", requires_grad=True)
                times = cuda_time_ms(_step(loss, be, q, k, logit), warmup=2, repeat=5)
                ms = statistics.median(times)
                flops = (8 if loss == "clip" else 6) * b * b * args.dim
                row = {"loss": loss, "variant": name, "batch": b, "median_ms": ms, "times_ms": times,
                       "tflops": flops / (ms * 1e-3) / 1e12, "max_rel_err_b4096": err}
                out["rows"].append(row)
                print(row, flush=True)
                del q, k
    write_json(args.out, out)


if __name__ == "__main__":
    main()
