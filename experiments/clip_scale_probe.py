"""Does the fused CLIP loss's speed depend on the logit scale? (one H200 visit)

Session 14's fp32-precision probe timed the bf16 CLIP loss at B = 32,768, D = 512 in 21.0 ms at
scale 100, against 14.0 ms at scale 1/0.07 in the benchmark. This times the forward (LSE) alone
and forward + backward at several scales on the same random unit features, bf16 and fp32 (TF32),
plus features whose positives are aligned (a trained model's), with the GPU's SM clock and power
sampled by nvidia-smi during each case (data-dependent power can lower the clock).

    python experiments/clip_scale_probe.py --out /tmp/clip_scale_probe.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

import bigbatch
from bigbatch.backends.triton_softmax import TritonTiles
from bigbatch.bench.common import cuda_time_ms, hardware, write_json


def _features(b: int, d: int, dtype: torch.dtype, aligned: bool):
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.nn.functional.normalize(torch.randn(b, d, device="cuda", generator=g), dim=1)
    k = torch.nn.functional.normalize(torch.randn(b, d, device="cuda", generator=g), dim=1)
    if aligned:  # positives at cosine ~0.7, negatives ~0
        k = torch.nn.functional.normalize(q + k, dim=1)
    return q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()


class Clocks:
    """nvidia-smi's SM clock (MHz) and power (W), sampled every 50 ms while inside the block."""

    def __enter__(self):
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=5)
        rows = [line.split(",") for line in out.strip().splitlines() if line.count(",") == 1]
        vals = [(float(a), float(b)) for a, b in rows if a.strip() and b.strip()]
        self.sm_mhz = statistics.median(v[0] for v in vals) if vals else None
        self.power_w = statistics.median(v[1] for v in vals) if vals else None
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=32768)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--scales", type=float, nargs="+", default=[1.0, 14.2857, 30.0, 100.0])
    args = p.parse_args()
    rows = []
    cases = [(torch.bfloat16, TritonTiles(), False), (torch.float32, TritonTiles(precision="tf32"), False),
             (torch.bfloat16, TritonTiles(), True)]
    for dtype, be, aligned in cases:
        q, k = _features(args.batch, args.dim, dtype, aligned)
        for scale in args.scales:
            s = torch.tensor(scale, device="cuda")

            def fwd():
                be.lse(q, k, s, rows=True, cols=True)

            def step():
                q.grad = k.grad = None
                bigbatch.clip_loss(q, k, s, backend=be).backward()

            row = {"dtype": str(dtype).replace("torch.", ""), "aligned": aligned, "scale": scale}
            for name, fn in (("fwd", fwd), ("fwd_bwd", step)):
                with Clocks() as c:
                    times = cuda_time_ms(fn, warmup=3, repeat=10)
                row[name + "_ms"] = statistics.median(times)
                row[name + "_sm_mhz"], row[name + "_power_w"] = c.sm_mhz, c.power_w
            rows.append(row)
            print(row, flush=True)
        del q, k
    write_json(args.out, {"hardware": hardware(), "batch": args.batch, "dim": args.dim, "rows": rows})


if __name__ == "__main__":
    main()
