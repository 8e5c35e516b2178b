"""Does measuring the planned chunk (session 16) slow the cached step that follows? Runs the
gradcache benchmark with the planner patched, one mode per process:

  measure   the library as it is (the planned chunk measured, up to two points per cost)
  none      no measurement (_PLAN_MEASURES = 0: the probes' line alone, as before session 16)
  empty     measured, then torch.cuda.empty_cache() after each plan that measured

usage: python experiments/gradcache_plan_measure_ab.py MODE [bench arguments...]
"""

from __future__ import annotations

import runpy
import sys

import torch

from bigbatch.gradcache import budget


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "none":
        budget._PLAN_MEASURES = 0
    elif mode == "empty":
        plan = budget.ChunkProber.plan

        def plan_then_empty(self, model, x, *args, **kwargs):
            before = len(args[-2].measured)  # args: get_rep, autocast_ctx, autocast, cost, budget
            rows, cost = plan(self, model, x, *args, **kwargs)
            if len(cost.measured) != before and torch.cuda.is_available():
                torch.cuda.empty_cache()
            return rows, cost

        budget.ChunkProber.plan = plan_then_empty
    elif mode != "measure":
        raise SystemExit(f"mode must be measure, none or empty, got {mode!r}")
    sys.argv = ["bigbatch.bench.gradcache"] + rest
    runpy.run_module("bigbatch.bench.gradcache", run_name="__main__")


if __name__ == "__main__":
    main()
