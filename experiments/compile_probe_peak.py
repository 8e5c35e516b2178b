"""Peak memory per row of a torch.compile'd BERT-base passage chunk's forward + backward (bf16),
before and after the module's no-grad (inference) graph was first used: the compiled benchmark
planned 308-row chunks (44 MiB/row) when its check had run the inference graph, 214 (65 MiB/row)
when it had not. Writes JSON to argv[1]."""

import json
import sys

import torch

from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep

dev = torch.device("cuda")
setup = DualEncoder(dev)
mp = torch.compile(setup.mp, dynamic=True)


def peak(rows, grad=True):
    x = _inputs(rows, 128, setup.cfg.vocab_size, dev, rows)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.set_grad_enabled(grad), torch.autocast("cuda", dtype=torch.bfloat16):
        r = _rep(mp(**x)).float()
    if grad:
        r.sum().backward()
    del r
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


out = {}
for phase in ("before_nograd", "after_nograd"):
    for rows in (16, 48, 16, 48, 128):
        out.setdefault(phase, []).append((rows, peak(rows)))
    if phase == "before_nograd":
        for rows in (16, 48, 128):
            out.setdefault("nograd", []).append((rows, peak(rows, grad=False)))
    print(phase, out[phase], flush=True)
print(out, flush=True)
open(sys.argv[1], "w").write(json.dumps(out, indent=1))
