"""Which host threads spend the cached step's CPU time, and what one LayerNorm backward costs
inside a real step? (one GPU, session 23)

``gradcache_lead_probe.py`` saw each passage chunk's backward take ~10 ms more host time with the
one-pass LayerNorm kernel than with PyTorch's (25 LayerNorms: ~400 us each), where the kernel's
Python backward body costs ~30 us on a CPU with its launch stubbed. Per arm (``norms.ENABLED`` on /
off), over 3 steps at B = 2,048 in the setting of ``bigbatch.bench.gradcache``: each thread's CPU
time (``/proc/self/task/*/stat``, named by ``comm``) against the wall time; the wall and CPU time
of every ``LayerNormFunction.backward`` body (``time.perf_counter`` / ``time.thread_time``: a body
whose wall time exceeds its CPU time waited -- for the GIL, or the allocator); the step time with
Python's thread switch interval at its default and at 0.1 ms.

    python experiments/gradcache_thread_probe.py --out /tmp/threads.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradcache_fused_ab import probe_main, switch_set  # noqa: E402
from gradcache_idle_probe import steps  # noqa: E402

from bigbatch.bench.common import hardware  # noqa: E402
from bigbatch.gradcache import norms  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict:
    """{tid: (name, cpu seconds)} of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def main() -> None:
    args, setup, qi, pi, bb = probe_main()
    res = {"hardware": hardware(), "batch": args.batch, "switch_interval_s": sys.getswitchinterval(),
           "python_threads": [t.name for t in threading.enumerate()]}
    original = norms.LayerNormFunction.backward
    bodies = []

    def timed(ctx, dy):
        w0, c0 = time.perf_counter(), time.thread_time()
        out = original(ctx, dy)
        bodies.append(((time.perf_counter() - w0) * 1e6, (time.thread_time() - c0) * 1e6))
        return out

    for arm, on in (("norm_kernel", True), ("pytorch_norms", False)):
        with switch_set(norms, on), mock.patch.object(norms.LayerNormFunction, "backward", staticmethod(timed)):
            steps(lambda: bb(qi, pi), 2)
            bodies.clear()
            before, t0 = thread_cpu(), time.perf_counter()
            ms, issue = steps(lambda: bb(qi, pi), 3)
            wall, after = time.perf_counter() - t0, thread_cpu()
            per = sorted(((after[t][0], round(after[t][1] - before.get(t, ("", 0.0))[1], 3)) for t in after),
                         key=lambda r: -r[1])
            row = {"ms": ms, "issue_ms": issue, "wall_s": wall, "thread_cpu_s": [r for r in per if r[1] > 0],
                   "norm_backward_calls": len(bodies)}
            if bodies:
                row["norm_backward_wall_us_median"] = statistics.median(b[0] for b in bodies)
                row["norm_backward_cpu_us_median"] = statistics.median(b[1] for b in bodies)
                row["norm_backward_wall_ms_total_per_step"] = sum(b[0] for b in bodies) / 3e3
                row["norm_backward_cpu_ms_total_per_step"] = sum(b[1] for b in bodies) / 3e3
            sys.setswitchinterval(1e-4)
            row["ms_switch_0.1ms"], _ = steps(lambda: bb(qi, pi), 3)
            sys.setswitchinterval(res["switch_interval_s"])
        res[arm] = row
        print(arm, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
