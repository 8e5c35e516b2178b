"""Host time per LayerNorm call on the GPU machine: PyTorch's against the one-pass kernel's
``OnePassLayerNorm`` (``gradcache/norms.py``), forward and backward, and the kernel's launch alone.

Small rows (64 x 768, bf16 autocast), so that the GPU finishes each call long before the host
issues the next: the wall time per call is the host's. Medians of 5 runs of 2,000 calls.

    python experiments/gradcache_norm_host_probe.py --out /tmp/norm_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from bigbatch.bench.common import hardware
from bigbatch.gradcache import norms
from bigbatch.gradcache.norm_kernel import layer_norm_backward


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    ln = nn.LayerNorm(768).to(dev)
    x = torch.randn(64, 768, device=dev, requires_grad=True)
    amp = dict(device_type="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.autocast(**amp):
            return ln(x)

    def fwd_bwd():
        fwd().float().sum().backward()

    res = {"hardware": hardware(), "shape": [64, 768]}
    res["pytorch_fwd_us"] = per_call_us(fwd)
    res["pytorch_fwd_bwd_us"] = per_call_us(fwd_bwd)
    saved = norms.ENABLED
    norms.ENABLED = True
    try:
        with norms.fast_layer_norms(norms.model_norms(ln)):
            assert type(ln) is norms.OnePassLayerNorm
            res["onepass_fwd_us"] = per_call_us(fwd)
            res["onepass_fwd_bwd_us"] = per_call_us(fwd_bwd)
            res["kernel_applies_us"] = per_call_us(lambda: norms.kernel_applies(ln, x))
    finally:
        norms.ENABLED = saved
    xb = x.detach().to(torch.bfloat16)
    dy = torch.randn_like(xb)
    res["kernel_launch_us"] = per_call_us(lambda: layer_norm_backward(xb, dy, ln.weight, 1e-12, True, True, True))
    res["empty_us"] = per_call_us(lambda: torch.empty(64, 768, device=dev))
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
