"""Where in a cached step does the GPU wait for the host? (one GPU)

The setting of ``bigbatch.bench.gradcache`` at B = 2,048 and a 16 GiB budget. One profiled call
each of the full-batch step and ``bigbatch.GradCache``: the idle gaps between consecutive
device intervals (kernels, copies, memsets), summed by the kernel that ends the gap (what the
GPU was waiting to receive) and by size; and host ranges (pass 1 per model, the loss, pass 2)
from ``record_function`` marks placed by wrapping the engine's functions, so each gap is also
attributed to the phase whose host range covers it. Each gap is also attributed to the host op
that launched the kernel ending it (the kernel's ``External id`` -> its CPU op -> the ops enclosing
it on that thread): the autograd node being evaluated (``bwd: ToCopyBackward0``) or, in a forward,
the outermost ATen op (``fwd: aten::linear``), and the innermost op.

    cd experiments && python gradcache_gap_probe.py --out /tmp/gradcache_gaps.json
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import record_function

import bigbatch.gradcache.cache as cache_mod
from bigbatch.bench.common import hardware
from bigbatch.bench.gradcache import DualEncoder, _rep
from bigbatch.gradcache import GradCache

from gradcache_fused_ab import full_step
from gradcache_idle_probe import device_intervals, trace_events

PHASES = ("bb_encode", "bb_backprop", "bb_loss")


def marked(fn, name):
    def wrapped(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    return wrapped


NODE = "autograd::engine::evaluate_function: "


def op_ancestry(events):
    """External id -> (autograd node or outermost ATen op, innermost op) of every CPU op, from a
    sweep over each thread's ops nested by time."""
    by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "External id" in e.get("args", {}):
            by_tid[e.get("tid")].append((float(e["ts"]), -float(e["dur"]), e["name"], e["args"]["External id"]))
    out = {}
    for ops in by_tid.values():
        ops.sort()
        stack = []  # (end, name)
        for ts, neg_dur, name, ext in ops:
            while stack and stack[-1][0] < ts:
                stack.pop()
            stack.append((ts - neg_dur, name))
            names = [n for _, n in stack]
            node = next((n for n in names if n.startswith(NODE)), None)
            if node is not None:
                key = "bwd: " + node[len(NODE):]
            else:
                key = "fwd: " + next((n for n in names if n.startswith("aten::")), names[0])
            out[ext] = (key, name)
    return out


def trace(fn):
    events, _ = trace_events(fn, cpu=True)
    dev = [(a, b, name, e.get("args", {}).get("External id"))
           for a, b, name, e in device_intervals(events, lambda e: e["name"][:70])]
    ancestry = op_ancestry(events)
    ranges = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events
              if e.get("ph") == "X" and e.get("name") in PHASES]
    by_next, by_phase, sizes = collections.Counter(), collections.Counter(), collections.Counter()
    by_node, by_op = collections.Counter(), collections.Counter()
    end = dev[0][1]
    idle = 0.0
    for a, b, name, ext in dev[1:]:
        gap = a - end
        if gap > 5.0:  # microseconds; below this it is launch latency between queued kernels
            idle += gap
            by_next[name] += gap / 1e3
            node, op = ancestry.get(ext, ("unknown", "unknown"))
            by_node[node] += gap / 1e3
            by_op[op] += gap / 1e3
            phase = next((p for (s, e, p) in ranges if s <= a <= e), "other")
            by_phase[phase] += gap / 1e3
            sizes["<50us" if gap < 50 else "<500us" if gap < 500 else "<5ms" if gap < 5000 else ">=5ms"] += gap / 1e3
        end = max(end, b)
    return {"span_ms": (end - dev[0][0]) / 1e3, "idle_ms": idle / 1e3, "kernels": len(dev),
            "by_phase_ms": dict(by_phase), "by_size_ms": dict(sizes),
            "by_next_kernel_ms": [[k, round(v, 3)] for k, v in by_next.most_common(25)],
            "by_launching_node_ms": [[k, round(v, 3)] for k, v in by_node.most_common(30)],
            "by_launching_op_ms": [[k, round(v, 3)] for k, v in by_op.most_common(20)],
            "phase_host_ms": {p: sum(e - s for s, e, q in ranges if q == p) / 1e3 for p in PHASES}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    setup = DualEncoder(device)
    cache_mod.encode = marked(cache_mod.encode, "bb_encode")
    cache_mod.backprop = marked(cache_mod.backprop, "bb_backprop")
    gc = GradCache([setup.mq, setup.mp], loss_fn=marked(setup.loss_fn, "bb_loss"), get_rep_fn=_rep,
                   autocast_dtype=torch.bfloat16, memory_budget="16GiB")
    qi, pi, full = full_step(setup, args.batch, device)
    out = {"experiment": "gradcache_gap_probe", "hardware": hardware(), "batch": args.batch}
    out["full"] = trace(full)
    out["gradcache"] = trace(lambda: gc(qi, pi))
    out["gradcache"]["chunk_rows"] = [list(r) for r in gc.last_chunk_rows]
    for k in [k for k in out if k.startswith(("full", "gradcache"))]:
        print(k, json.dumps({kk: v for kk, v in out[k].items() if not kk.startswith("by_")}), flush=True)
        for key in ("by_next_kernel_ms", "by_launching_node_ms", "by_launching_op_ms"):
            print("  ", key)
            for name, ms in out[k][key][:12]:
                print("   ", ms, name)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
