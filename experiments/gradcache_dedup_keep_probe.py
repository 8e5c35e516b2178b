"""Follow-up of gradcache_dedup_slow_probe: a dedup_saved GradCache step with a memory budget at
B = 2048 ran 1.2-1.7 s while fixed chunk sizes of the same shape (no kept graph) ran 0.88 s.
Variants (blocks of CUDA-event times): the budget with and without the kept last graph, with
Python's cyclic GC paused, and plain; then one profiled step of the slow variant (top host and
GPU ops) beside one of plain.

    cd experiments && python gradcache_dedup_keep_probe.py --out ../benchmarks/results/probes/gradcache_dedup_keep_h200.json
"""

from __future__ import annotations

import gc

import torch

from bigbatch.bench.gradcache import _rep
from bigbatch.gradcache import GradCache

from gradcache_chunk_shape_probe import peak_gib
from gradcache_dedup_slow_probe import block
from gradcache_fused_ab import ab_setup, full_step, record


def main() -> None:
    args, device, setup, out = ab_setup("gradcache_dedup_keep_probe", [2048], 1, 3)
    kw = dict(loss_fn=setup.loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16, memory_budget="16GiB")
    b = args.batches[0]
    qi, pi, _ = full_step(setup, b, device)
    cases = {
        "dedup_keep": GradCache([setup.mq, setup.mp], **kw),
        "dedup_nokeep": GradCache([setup.mq, setup.mp], keep_last_graph=False, **kw),
        "plain_keep": GradCache([setup.mq, setup.mp], dedup_saved=False, **kw),
    }
    row = {"batch": b}
    for name, gcache in cases.items():
        r = block(lambda: gcache(qi, pi), args.repeat)
        r.update(chunk_rows=[list(x) for x in gcache.last_chunk_rows], kept_rows=list(gcache.last_kept_rows),
                 peak_total_gib=peak_gib(lambda: gcache(qi, pi)))
        row[name] = r
        print(name, {k: v for k, v in r.items() if k != "times_ms"}, flush=True)

    def nogc():
        gc.disable()
        try:
            cases["dedup_keep"](qi, pi)
        finally:
            gc.enable()
    row["dedup_keep_nogc"] = block(nogc, args.repeat)
    print("dedup_keep_nogc", row["dedup_keep_nogc"]["median_ms"], flush=True)
    from torch.profiler import ProfilerActivity, profile
    for name in ("dedup_keep", "plain_keep"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            cases[name](qi, pi)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        row[f"{name}_top_cpu"] = ka.table(sort_by="self_cpu_time_total", row_limit=12)
        row[f"{name}_top_cuda"] = ka.table(sort_by="self_cuda_time_total", row_limit=12)
        print(name, row[f"{name}_top_cpu"], row[f"{name}_top_cuda"], sep="\n", flush=True)
    record(out, row, {}, args.out)


if __name__ == "__main__":
    main()
