"""Interleaved A/B in one process of two versions of the library's cached step (one GPU).

Cross-process comparisons on the GPU machine are noisy (host speed differs by ~10% per process,
session 19), and not every change has a switch. This loads an older copy of the package under
another name (``--old``: a directory holding ``bigbatch_old/``, e.g. made by
``git worktree add /tmp/old <commit> && cp -r /tmp/old/src/bigbatch DIR/bigbatch_old``; the
package imports itself relatively), builds ``GradCache`` from each on the same models, and
alternates their steps. The setting of ``bigbatch.bench.gradcache`` (BERT-base dual encoder,
bf16 autocast, 16 GiB budget); per batch size the full step's median, then per version the
CUDA-event and host-issue medians, and one profiled step each (GPU busy, kernels). Writes JSON.

    python experiments/gradcache_version_ab.py --old /tmp/oldpkg --batches 512 1024 2048 --out /tmp/version_ab.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradcache_fused_ab import full_step  # noqa: E402
from gradcache_idle_probe import busy, steps  # noqa: E402

from bigbatch.bench.common import hardware  # noqa: E402
from bigbatch.bench.gradcache import DualEncoder, _rep  # noqa: E402
from bigbatch.gradcache import GradCache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old", required=True, help="directory holding the older package as bigbatch_old/")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    sys.path.insert(0, args.old)
    OldGradCache = importlib.import_module("bigbatch_old.gradcache").GradCache
    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    mq, mp, loss_fn = setup.mq, setup.mp, setup.loss_fn
    res = {"hardware": hardware(), "old": args.old, "env": {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED")}, "rows": []}
    for b in args.batches:
        qi, pi, full = full_step(setup, b, dev)
        kw = dict(memory_budget="16GiB", loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
        versions = {"new": GradCache([mq, mp], **kw), "old": OldGradCache([mq, mp], **kw)}
        steps(full, 2)
        full_ms, _ = steps(full, 5)
        for gc in versions.values():
            steps(lambda: gc(qi, pi), 2)
        got = {name: {"ms": [], "issue_ms": []} for name in versions}
        for _ in range(args.rounds):
            for name, gc in versions.items():
                ms, issue = steps(lambda: gc(qi, pi), 1)
                got[name]["ms"] += ms
                got[name]["issue_ms"] += issue
        row = {"batch": b, "full_ms": statistics.median(full_ms), "full_times_ms": full_ms,
               "plans": {n: [list(r) for r in gc.last_chunk_rows] for n, gc in versions.items()}}
        for name, gc in versions.items():
            prof = busy(lambda: gc(qi, pi))
            med = statistics.median(got[name]["ms"])
            row[name] = {"median_ms": med, "over_full": med / row["full_ms"],
                         "issue_median_ms": statistics.median(got[name]["issue_ms"]), **got[name],
                         "busy_ms": prof["busy_ms"], "idle_in_span_ms": prof["idle_in_span_ms"], "kernels": prof["kernels"]}
        res["rows"].append(row)
        print(f"B={b} full {row['full_ms']:.1f} | " + " | ".join(
            f"{n} {row[n]['median_ms']:.1f} ({row[n]['over_full']:.3f}) issue {row[n]['issue_median_ms']:.1f} "
            f"busy {row[n]['busy_ms']:.1f} kernels {row[n]['kernels']}" for n in versions), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
