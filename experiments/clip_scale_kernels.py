"""Per-kernel GPU time of the fused bf16 CLIP loss (forward + backward) at logit scales 14.3 and
100 (B = 32,768, D = 512, random unit features), from torch.profiler: which kernel's time depends
on the scale (clip_scale_probe.py found the backward ~40% slower at 100).

    python experiments/clip_scale_kernels.py --out /tmp/clip_scale_kernels.json
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import bigbatch
from bigbatch.bench.common import hardware, write_json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=32768)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.nn.functional.normalize(torch.randn(args.batch, 512, device="cuda", generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(args.batch, 512, device="cuda", generator=g), dim=1)
    q, k = q.bfloat16().requires_grad_(), k.bfloat16().requires_grad_()
    out = {"hardware": hardware(), "batch": args.batch, "scales": {}}
    for scale in (14.2857, 100.0, 14.2857, 100.0):
        s = torch.tensor(scale, device="cuda")

        def step():
            q.grad = k.grad = None
            bigbatch.clip_loss(q, k, s).backward()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        per = collections.defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                per[ev.name[:90]] += ev.device_time / 3 / 1000.0  # ms per step
        top = dict(sorted(per.items(), key=lambda kv: -kv[1])[:8])
        out["scales"].setdefault(str(scale), []).append(top)
        print(scale, {k_: round(v, 3) for k_, v in top.items()}, flush=True)
    write_json(args.out, out)


if __name__ == "__main__":
    main()
