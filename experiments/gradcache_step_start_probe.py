"""Host time from a cached step's call to its first forward, on the GPU machine (session 23).

At the start of a step the GPU has nothing queued (the benchmark times each step from an event
recorded just before the call), so the library's host work before the first forward is GPU idle
time that the full-batch step does not have (``gradcache_lead_probe.py`` saw ~7 ms of it at
B = 2,048 on the H200 host). The setting of ``bigbatch.bench.gradcache`` (BERT-base dual encoder,
bf16, 16 GiB budget); a forward pre-hook on the first model raises at its first call, so each call
runs exactly the step's start. Reports the median time of such aborted calls and cProfile's
tables (cumulative and own time) of 50 of them, and the cost of a few torch queries alone.

    python experiments/gradcache_step_start_probe.py --out /tmp/start.json
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradcache_fused_ab import probe_main  # noqa: E402
from gradcache_idle_probe import steps  # noqa: E402

from bigbatch.bench.common import hardware  # noqa: E402


class Stop(Exception):
    pass


def per_call_us(fn, n: int = 200) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    args, setup, qi, pi, bb = probe_main()
    dev = torch.device("cuda")
    steps(lambda: bb(qi, pi), 3)
    stop = [False]

    def pre(mod, args_):
        if stop[0]:
            raise Stop

    setup.mq.register_forward_pre_hook(pre)
    stop[0] = True

    def aborted():
        try:
            bb(qi, pi)
        except Stop:
            pass
        torch.cuda.synchronize()

    times = []
    for _ in range(60):
        t0 = time.perf_counter()
        aborted()
        times.append((time.perf_counter() - t0) * 1e3)
    res = {"hardware": hardware(), "batch": args.batch, "aborted_call_ms": statistics.median(times[10:])}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        aborted()
    prof.disable()
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
        res[f"cprofile_{key}"] = s.getvalue()
    stop[0] = False
    steps(lambda: bb(qi, pi), 1)  # the step still runs after the aborted ones
    res["queries_us"] = {
        "memory_allocated": per_call_us(lambda: torch.cuda.memory_allocated(dev)),
        "memoryStats_raw": per_call_us(lambda: torch._C._cuda_memoryStats(0)) if hasattr(torch._C, "_cuda_memoryStats") else None,
        "cuda_get_rng_state": per_call_us(lambda: torch.cuda.get_rng_state(dev)),
        "cpu_get_rng_state": per_call_us(torch.get_rng_state),
        "current_stream": per_call_us(torch.cuda.current_stream),
        "event_record": per_call_us(lambda: torch.cuda.Event().record()),
    }
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("cprofile")}, indent=1))
    print(res["cprofile_cumulative"][:6000])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
