"""Why is the cached step at B = 512 ~200 ms in some processes and ~230 ms in others? (one GPU)

The setting of ``bigbatch.bench.gradcache`` (BERT-base dual encoder, bf16 autocast, 16 GiB budget).
One process = one sample: run it several times (e.g. with different ``PYTHONHASHSEED`` or
``PYTORCH_CUDA_ALLOC_CONF``) and compare. Per process it records every step's CUDA-event time and
host issue time (until the call returns), the caching allocator's counters over the timed steps
(device mallocs / frees, retries: a step that has to ``cudaMalloc`` stalls the GPU), the GPU's busy
time and idle gaps in one profiled step with its top kernels, the full step's time, and where the
process runs (CPU core, affinity). Appends one JSON line to ``--out``.

    for s in 0 1 2 3; do PYTHONHASHSEED=$s python experiments/gradcache_bimodal_probe.py --out /tmp/bimodal.jsonl; done
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradcache_fused_ab import full_step  # noqa: E402  (experiments next to this one)
from gradcache_idle_probe import busy, steps  # noqa: E402

from bigbatch.bench.common import hardware  # noqa: E402
from bigbatch.bench.gradcache import DualEncoder, _rep  # noqa: E402
from bigbatch.gradcache import GradCache  # noqa: E402

COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams", "num_ooms")


def _cpu_now() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39: the CPU last run on


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    mq, mp, loss_fn = setup.mq, setup.mp, setup.loss_fn
    b = args.batch
    qi, pi, full = full_step(setup, b, dev)
    bb = GradCache([mq, mp], memory_budget="16GiB", loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
    row = {"hardware": hardware(), "batch": b, "env": {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "PYTORCH_CUDA_ALLOC_CONF")},
           "affinity": sorted(os.sched_getaffinity(0)), "cpu_at_start": _cpu_now()}
    full_ms, full_issue = steps(full, 2)
    full_ms, full_issue = steps(full, 5)
    row["full_ms"], row["full_issue_ms"] = full_ms, full_issue
    steps(lambda: bb(qi, pi), 2)  # plans (probes) and warms up
    row["plan"] = {"chunk_rows": [list(r) for r in bb.last_chunk_rows], "kept_rows": list(bb.last_kept_rows)}
    before = torch.cuda.memory_stats()
    ms, issue = steps(lambda: bb(qi, pi), args.repeat)
    after = torch.cuda.memory_stats()
    row["cached_ms"], row["cached_issue_ms"] = ms, issue
    row["cached_median_ms"], row["full_median_ms"] = statistics.median(ms), statistics.median(full_ms)
    row["ratio"] = row["cached_median_ms"] / row["full_median_ms"]
    row["allocator_delta"] = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    row["reserved_gib"] = after.get("reserved_bytes.all.current", 0) / 2**30
    row["segments"] = after.get("segment.all.current", 0)
    row["cpu_after_steps"] = _cpu_now()
    prof = busy(lambda: bb(qi, pi))
    prof["top"] = prof["top"][:25]
    row["profile_cached"] = prof
    row["process_s"] = time.perf_counter() - t_start
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"seed={row['env']['PYTHONHASHSEED']} alloc={row['env']['PYTORCH_CUDA_ALLOC_CONF']} full={row['full_median_ms']:.1f} "
          f"cached={row['cached_median_ms']:.1f} ({[round(x) for x in ms]}) issue={statistics.median(issue):.1f} "
          f"busy={prof['busy_ms']:.1f} idle={prof['idle_in_span_ms']:.1f} alloc={row['allocator_delta']} cpu={row['cpu_after_steps']} "
          f"{row['process_s']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
