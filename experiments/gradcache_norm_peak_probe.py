"""Memory of one passage chunk's forward + backward with PyTorch's LayerNorm and with the one-pass
kernel's (``gradcache/norms.py``), on the GPU machine (session 22).

In session 22's switch A/Bs the planner gave the kernel arm smaller chunks (a 260-row last passage
chunk against 276) and its steps still peaked higher (15.31-15.33 GiB against 15.26-15.28), while
the bytes autograd saves are the same (measured on the CPU). This measures, for the benchmark's
passage encoder (BERT-base, 128 tokens, bf16 autocast), at a few chunk sizes and for both arms:
the memory the forward leaves held, the forward + backward's peak above the start, and the time of
forward + backward (CUDA events, median of 5).

    python experiments/gradcache_norm_peak_probe.py --out /tmp/norm_peak.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradcache_fused_ab import switch_set  # noqa: E402  (an experiment next to this one)

from bigbatch.bench.common import hardware  # noqa: E402
from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep  # noqa: E402
from bigbatch.gradcache import norms  # noqa: E402


def one(model, inp, use_kernel: bool) -> dict:
    times = []
    with switch_set(norms, use_kernel):
        for i in range(7):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with norms.fast_layer_norms(norms.model_norms(model)):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    rep = _rep(model(**inp)).float()
                held = torch.cuda.memory_allocated() - base
                rep.backward(torch.ones_like(rep))
            end.record()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            if i >= 2:
                times.append(start.elapsed_time(end))
    return {"held_mib": held / 2**20, "peak_mib": peak / 2**20, "ms": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[48, 128, 276])
    args = p.parse_args()
    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    res = {"hardware": hardware(), "rows": []}
    for r in args.rows:
        inp = _inputs(r, 128, setup.cfg.vocab_size, dev, 1)
        row = {"rows": r, "pytorch": one(setup.mp, inp, False), "kernel": one(setup.mp, inp, True)}
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
