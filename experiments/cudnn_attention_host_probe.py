"""Host time per call of SDPA's cuDNN attention (forward, and forward + backward) by batch size,
as BERT-base calls it (12 heads, 64 dims, bf16, q/k/v transposed views of [b, s, 768] projections,
no mask, dropout 0.1 in training), against the flash backend. Gradient-caching chunks of some row
counts made cuDNN attention's host time per call double (gradcache_dedup_keep_h200.json).

    cd experiments && python cudnn_attention_host_probe.py --out ../benchmarks/results/probes/cudnn_attention_host_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bigbatch.bench.common import write_json


def host_ms(b: int, s: int, backend, backward: bool, calls: int = 12) -> dict:
    x = [torch.randn(b, s, 768, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(3)]
    q, k, v = (t.view(b, s, 12, 64).transpose(1, 2) for t in x)
    out = []
    for i in range(calls + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
            if backward:
                o.backward(torch.ones_like(o))
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 2:
            out.append((t1 - t0) * 1e3)
    return {"median_host_ms": statistics.median(out), "max_host_ms": max(out)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {"experiment": "cudnn_attention_host_probe", "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rows": []}
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        for s, sizes in ((128, [64, 254, 255, 268, 336, 337, 365, 512, 1024]), (32, [547, 965, 1024, 1083, 1501, 2048])):
            for b in sizes:
                for backward in (False, True):
                    r = {"backend": backend.name, "seq": s, "batch": b, "backward": backward, **host_ms(b, s, backend, backward)}
                    print(r, flush=True)
                    res["rows"].append(r)
    write_json(args.out, res)


if __name__ == "__main__":
    main()
