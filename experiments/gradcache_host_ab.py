"""A/B of host-side settings around a ``bigbatch.GradCache`` step at a 16 GiB budget (one GPU).

The setting of ``bigbatch.bench.gradcache``. Variants, interleaved with the full-batch step
(CUDA-event medians):

* ``default``: the library as it is;
* ``nogc``: Python's cyclic garbage collector paused for the step (a cached step runs ~18
  forwards' worth of Python objects, the full step one; a collection while the host issues
  kernels is GPU idle time);
* ``f98``: chunks planned against 98% of the budget instead of 95% (larger chunks; its peak is
  recorded, it must stay under 16 GiB).

    cd experiments && python gradcache_host_ab.py --out /tmp/gradcache_host_ab.json
"""

from __future__ import annotations

import gc

import torch

import bigbatch.gradcache.cache as cache_mod
from bigbatch.bench.gradcache import _rep
from bigbatch.gradcache import GradCache

from gradcache_chunk_shape_probe import GIB, peak_gib
from gradcache_fused_ab import ab_setup, full_step, interleaved, record


def gc_time(fn):
    """Collections (per generation) and host ms spent in the cyclic GC during one call."""
    import time

    stats = {"collections": [0, 0, 0], "ms": 0.0}
    t0 = [0.0]

    def cb(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            stats["ms"] += (time.perf_counter() - t0[0]) * 1e3
            stats["collections"][info["generation"]] += 1

    gc.callbacks.append(cb)
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        gc.callbacks.remove(cb)
    return stats


def main() -> None:
    args, device, setup, out = ab_setup("gradcache_host_ab", [2048, 1024], 4, 2)
    kw = dict(loss_fn=setup.loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16, memory_budget="16GiB")
    default, f98 = GradCache([setup.mq, setup.mp], **kw), GradCache([setup.mq, setup.mp], **kw)

    for b in args.batches:
        qi, pi, full = full_step(setup, b, device)

        def nogc():
            was = gc.isenabled()
            gc.disable()
            try:
                default(qi, pi)
            finally:
                if was:
                    gc.enable()

        def larger():
            cache_mod._BUDGET_FRACTION = 0.98
            try:
                f98(qi, pi)
            finally:
                cache_mod._BUDGET_FRACTION = 0.95

        variants = {"full": full, "default": lambda: default(qi, pi), "nogc": nogc, "f98": larger}
        timed = interleaved(variants, args.rounds, args.repeat, f"B={b}")
        row = {"batch": b}
        for name in variants:
            row[name] = timed[name]
            row[f"{name}_over_full"] = timed[name]["median_ms"] / timed["full"]["median_ms"]
        row["f98"].update(chunk_rows=[list(r) for r in f98.last_chunk_rows], peak_total_gib=peak_gib(larger))
        row["default"].update(chunk_rows=[list(r) for r in default.last_chunk_rows], peak_total_gib=peak_gib(variants["default"]))
        row["gc_in_default_step"] = gc_time(variants["default"])
        record(out, row, variants, args.out)
    print("peak budget GiB", 16, "base", torch.cuda.memory_allocated() / GIB)


if __name__ == "__main__":
    main()
