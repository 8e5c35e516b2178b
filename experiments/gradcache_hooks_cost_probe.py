"""Does a saved-tensor hook slow a BERT chunk's forward + backward? One passage chunk (BERT-base,
bf16 autocast, dropout on), repeated: no hooks, identity saved-tensor hooks, bigbatch's SavedOnce,
at two chunk sizes; CUDA-event ms per call and host ms (until the call returns, before the sync).

    cd experiments && python gradcache_hooks_cost_probe.py --out ../benchmarks/results/probes/gradcache_hooks_cost_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep
from bigbatch.gradcache.saved import SavedOnce


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    setup = DualEncoder(device)
    m = setup.mp
    ctxs = {"none": contextlib.nullcontext,
            "identity_hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
            "saved_once": SavedOnce}
    res = {"experiment": "gradcache_hooks_cost_probe", "device": torch.cuda.get_device_name(), "rows": []}
    for rows in (254, 337):
        x = _inputs(rows, 128, setup.cfg.vocab_size, device, 1)
        for name, ctx in ctxs.items():
            host, gpu = [], []
            for i in range(6):
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                s.record()
                with torch.autocast("cuda", dtype=torch.bfloat16), ctx():
                    rep = _rep(m(**x))
                rep.float().sum().backward()
                e.record()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                if i >= 2:
                    host.append((t1 - t0) * 1e3)
                    gpu.append(s.elapsed_time(e))
            r = {"rows": rows, "hooks": name, "host_ms": statistics.median(host), "event_ms": statistics.median(gpu)}
            print(r, flush=True)
            res["rows"].append(r)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
