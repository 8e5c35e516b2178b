"""Why a dedup_saved GradCache step at B = 2048 took 1.3-1.5 s (gradcache_dedup_ab_h200.json) when
B = 1024 took 0.41 s: fixed chunk shapes, dedup on and off, before and after the full-batch step
has filled the allocator's cache, with the allocator's retry and cudaMalloc counts per block.

    cd experiments && python gradcache_dedup_slow_probe.py --out ../benchmarks/results/probes/gradcache_dedup_slow_h200.json
"""

from __future__ import annotations

import statistics

import torch

from bigbatch.bench.gradcache import _rep
from bigbatch.gradcache import GradCache

from gradcache_chunk_shape_probe import peak_gib
from gradcache_fused_ab import ab_setup, full_step, once_ms, record


def block(fn, repeat: int):
    fn()
    s0 = torch.cuda.memory_stats()
    times = [once_ms(fn) for _ in range(repeat)]
    s1 = torch.cuda.memory_stats()
    return {"median_ms": statistics.median(times), "times_ms": times,
            "alloc_retries": s1.get("num_alloc_retries", 0) - s0.get("num_alloc_retries", 0),
            "device_allocs": s1.get("num_device_alloc", 0) - s0.get("num_device_alloc", 0),
            "reserved_gib": torch.cuda.memory_reserved() / 2**30}


def main() -> None:
    args, device, setup, out = ab_setup("gradcache_dedup_slow_probe", [2048], 1, 3)
    kw = dict(loss_fn=setup.loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
    b = args.batches[0]
    qi, pi, full = full_step(setup, b, device)
    cases = {
        "dedup_q1024_p337": GradCache([setup.mq, setup.mp], chunk_sizes=[1024, 337], **kw),
        "dedup_q1667_p337": GradCache([setup.mq, setup.mp], chunk_sizes=[1667, 337], **kw),
        "plain_q1667_p254": GradCache([setup.mq, setup.mp], chunk_sizes=[1667, 254], dedup_saved=False, **kw),
        "dedup_budget": GradCache([setup.mq, setup.mp], memory_budget="16GiB", **kw),
        "plain_budget": GradCache([setup.mq, setup.mp], memory_budget="16GiB", dedup_saved=False, **kw),
    }
    row = {"batch": b}
    for phase in ("before_full", "after_full"):
        if phase == "after_full":
            row["full"] = block(full, args.repeat)
        for name, gcache in cases.items():
            r = block(lambda: gcache(qi, pi), args.repeat)
            r.update(chunk_rows=[list(x) for x in gcache.last_chunk_rows], peak_total_gib=peak_gib(lambda: gcache(qi, pi)))
            row[f"{phase}/{name}"] = r
            print(phase, name, {k: v for k, v in r.items() if k != "times_ms"}, flush=True)
    row["dedup_budget_cost_mib"] = [{k: round(v / 2**20, 3) for k, v in vars(c).items()}
                                    for c in cases["dedup_budget"]._prober._cache.values()]
    record(out, row, {}, args.out)


if __name__ == "__main__":
    main()
