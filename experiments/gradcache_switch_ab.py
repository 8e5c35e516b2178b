"""Interleaved A/B in one process of library switches in the cached step (``--arms``):

* ``memo``: the library as it is (its defaults);
* ``every_time``: the structure walks made afresh at every use, as before ``gradcache/walk.py``
  (``modules()`` / ``parameters()`` at each use, ~40 walks per step plus two per chunk);
* ``pytorch_norms`` / ``norm_kernel``: PyTorch's LayerNorm backward / the one-pass kernel
  (``gradcache/norms.py``'s ``ENABLED`` off / on; off by default since session 19): on a
  host-bound step the kernel's Python autograd Function costs host time while it saves GPU time;
* ``cast_scope`` / ``scope_off``: one autocast context from the last model of pass 1 into its
  re-runs (``gradcache/cast_scope.py``, the default since session 20) / one per pass and model;
* (session 21, commit 21e9cb9: ``uncached_casts``, graph-building forwards casting each weight at
  each use -- slower at every B, ``probes/uncached_casts_ab_s21.json``; removed with its switch.)

The setting of ``bigbatch.bench.gradcache`` (BERT-base dual encoder, bf16 autocast, 16 GiB budget).
Per batch size: the full step's median, then rounds that alternate the arms step by step
(CUDA-event time and host issue time of each step), and one profiled step per arm (GPU busy time,
idle inside the step); then each arm's gradients from zero under one seed against the first arm's,
and its peak. Writes JSON.

    python experiments/gradcache_switch_ab.py --batches 512 1024 2048 --arms memo every_time --out /tmp/ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from typing import Dict, List
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradcache_fused_ab import full_step, switch_set  # noqa: E402
from gradcache_idle_probe import busy, steps  # noqa: E402

from bigbatch.bench.common import hardware  # noqa: E402
from bigbatch.bench.gradcache import DualEncoder, _rep  # noqa: E402
from bigbatch.gradcache import GradCache, cast_scope, norms, walk  # noqa: E402


def _walk_every_time(models) -> List[torch.nn.Module]:
    out: Dict[int, torch.nn.Module] = {}
    for model in models:
        for m in model.modules():
            out.setdefault(id(m), m)
    return list(out.values())


@contextlib.contextmanager
def unmemoised():
    """The walks as before walk.py: computed at every use."""
    saved = walk.memoised, walk.fresh_submodules
    walk.memoised = lambda kind, module, compute: compute(module)
    walk.fresh_submodules = _walk_every_time
    try:
        yield
    finally:
        walk.memoised, walk.fresh_submodules = saved


@contextlib.contextmanager
def norm_kernel_through_jit():
    """The one-pass LayerNorm kernel launched through Triton's JIT at every call (session 22's
    direct launch off)."""
    from bigbatch.gradcache import norm_kernel

    with switch_set(norms, True), mock.patch.object(norm_kernel, "DIRECT", False):
        yield


ARMS = {"memo": contextlib.nullcontext, "every_time": unmemoised,
        "pytorch_norms": lambda: switch_set(norms, False), "norm_kernel": lambda: switch_set(norms, True),
        "norm_kernel_jit": norm_kernel_through_jit,
        "cast_scope": lambda: switch_set(cast_scope, True), "scope_off": lambda: switch_set(cast_scope, False)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--arms", nargs="+", default=["memo", "every_time"], choices=sorted(ARMS))
    args = p.parse_args()
    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    mq, mp, loss_fn = setup.mq, setup.mp, setup.loss_fn
    res = {"hardware": hardware(), "env": {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED")}, "rows": []}
    for b in args.batches:
        qi, pi, full = full_step(setup, b, dev)
        bb = GradCache([mq, mp], memory_budget="16GiB", loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
        steps(full, 2)
        full_ms, _ = steps(full, 5)
        arms = {name: ARMS[name] for name in args.arms}
        for ctx in arms.values():
            with ctx():
                steps(lambda: bb(qi, pi), 2)
        got = {name: {"ms": [], "issue_ms": []} for name in arms}
        for _ in range(args.rounds):
            for name, ctx in arms.items():
                with ctx():
                    ms, issue = steps(lambda: bb(qi, pi), 1)
                got[name]["ms"] += ms
                got[name]["issue_ms"] += issue
        row = {"batch": b, "full_ms": statistics.median(full_ms), "full_times_ms": full_ms,
               "plan": [list(r) for r in bb.last_chunk_rows], "kept_rows": list(bb.last_kept_rows)}
        for name, ctx in arms.items():
            with ctx():
                prof = busy(lambda: bb(qi, pi))
            row[name] = {"median_ms": statistics.median(got[name]["ms"]), "over_full": statistics.median(got[name]["ms"]) / row["full_ms"],
                         "issue_median_ms": statistics.median(got[name]["issue_ms"]), **got[name],
                         "busy_ms": prof["busy_ms"], "idle_in_span_ms": prof["idle_in_span_ms"], "kernels": prof["kernels"]}
        # each arm's gradients from zero under one seed, against the first arm's; and its peak. The
        # .grad tensors are zeroed, not dropped, and the first arm's gradients wait on the CPU: the
        # memory allocated at each check's start, so its plan (and so every chunk's dropout masks),
        # stays the timed steps', and the arms' gradients are comparable. (Until session 22 the
        # first arm's 0.9 GB stayed on the GPU: later arms planned smaller chunks, peaked higher and
        # drew other masks, hence "gradient differences" of 0.6-1.0 in the JSON files of sessions 21-22.)
        first = None
        for name, ctx in arms.items():
            with ctx():
                for m in (mq, mp):
                    m.zero_grad(set_to_none=False)
                torch.manual_seed(0)
                torch.cuda.reset_peak_memory_stats()
                bb(qi, pi)
            row[name]["check_plan"] = [list(r) for r in bb.last_chunk_rows]
            row[name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            flat = torch.cat([q.grad.flatten() for m in (mq, mp) for q in m.parameters() if q.grad is not None]).cpu()
            first = flat if first is None else first
            row[name]["grad_vs_first_arm"] = ((flat - first).abs().max() / first.abs().max()).item()
            row[name]["grads_bitwise_first_arm"] = bool(torch.equal(flat, first))
        del first, flat
        res["rows"].append(row)
        print(f"B={b} full {row['full_ms']:.1f} | " + " | ".join(
            f"{n} {row[n]['median_ms']:.1f} ({row[n]['over_full']:.3f}) issue {row[n]['issue_median_ms']:.1f} busy {row[n]['busy_ms']:.1f} "
            f"peak {row[n]['peak_gib']:.2f} GiB grad diff {row[n]['grad_vs_first_arm']:.1e}"
            for n in arms), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
