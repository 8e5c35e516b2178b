"""Why the compiled benchmark's correctness check differed (3.4% vs 0.25% eager): run the same
check (BERT-base dual encoder, B = 64, chunks of 16, bf16) several times and compare every pair
of runs per parameter group, compiled and eager. Writes JSON to argv[1]."""

import json
import sys

import torch

import bigbatch
from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep
from bigbatch.gradcache import GradCache
from bigbatch.gradcache.chunking import split_batch

out = {}
dev = torch.device("cuda")
setup = DualEncoder(dev)
amp = dict(device_type="cuda", dtype=torch.bfloat16)
qi, pi = _inputs(64, 32, setup.cfg.vocab_size, dev, 1), _inputs(64, 128, setup.cfg.vocab_size, dev, 2)
names = [f"q.{n}" for n, _ in setup.mq.named_parameters()] + [f"p.{n}" for n, _ in setup.mp.named_parameters()] + ["scale"]


def group(n):
    parts = n.split(".")
    return ".".join(parts[:4]) if len(parts) > 1 and parts[1] == "encoder" else ".".join(parts[:2])


for mode in ("compiled", "eager"):
    mq, mp = setup.mq, setup.mp
    if mode == "compiled":
        mq, mp = torch.compile(mq, dynamic=True), torch.compile(mp, dynamic=True)

    def ref():
        with torch.autocast(**amp):
            q = torch.cat([_rep(mq(**c)) for c in split_batch(qi, 16, )])
            k = torch.cat([_rep(mp(**c)) for c in split_batch(pi, 16, )])
            loss = setup.loss_fn(q, k)
        loss.backward()
        return loss

    def gc():
        return GradCache([mq, mp], chunk_sizes=16, loss_fn=setup.loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)(qi, pi)

    runs = {}
    for name, fn in (("ref1", ref), ("gc1", gc), ("ref2", ref), ("gc2", gc), ("gc3", gc)):
        for t in setup.params:
            t.grad.zero_()
        torch.manual_seed(5)
        loss = fn().item()
        runs[name] = (loss, {n: t.grad.float().clone() for n, t in zip(names, setup.params)})
    res = {"loss": {k: v[0] for k, v in runs.items()}}
    for a, b in (("ref1", "ref2"), ("gc1", "gc2"), ("gc2", "gc3"), ("ref2", "gc2"), ("ref1", "gc1")):
        ga, gb = runs[a][1], runs[b][1]
        flat = lambda g: torch.cat([v.flatten() for v in g.values()])
        tot = ((flat(ga) - flat(gb)).norm() / flat(gb).norm()).item()
        per = {}
        for n in names:
            per.setdefault(group(n), [0.0, 0.0])
            per[group(n)][0] += (ga[n] - gb[n]).norm().item() ** 2
            per[group(n)][1] += gb[n].norm().item() ** 2
        worst = sorted(((d / max(r, 1e-30)) ** 0.5, g) for g, (d, r) in per.items())[-6:]
        res[f"{a}_vs_{b}"] = {"total": tot, "worst_groups": worst}
    out[mode] = res
    print(mode, json.dumps(res, indent=1), flush=True)
open(sys.argv[1], "w").write(json.dumps(out, indent=1))
