"""How far ahead of the GPU is the host, along a cached step? (one GPU, session 23)

Unprofiled (the profiler slows the host, which moves the very gaps it measures): marks at every
model forward, every BERT layer's forward, every layer's backward (a hook on its output's
gradient) and around the loss, each a host time stamp and a CUDA event recorded at that point.
After the step, per mark: ``host_ms`` (when the host issued it, from the step's start), ``gpu_ms``
(when the GPU reached it) and ``lead_ms = gpu_ms - host_ms``: how much work the host had queued
ahead of the GPU there. Where the lead falls to ~0 the GPU had run dry and waited for the host.
Summed per phase (pass 1 / re-run forward / backward, per model, loss): marks, the smallest
lead, marks with a lead under 0.1 ms, and the host and GPU time between the phase's first and
last marks. Also the host syncs of one step (``torch.cuda.set_sync_debug_mode``) and Python's
garbage collections during the marked steps (``gc.callbacks``: count and host time per generation,
each also a mark ``gc.<generation>`` at its end).

The setting of ``bigbatch.bench.gradcache`` (BERT-base dual encoder, bf16, 16 GiB budget).

    python experiments/gradcache_lead_probe.py --batches 1024 2048 --arms pytorch_norms norm_kernel --out /tmp/lead.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gradcache_fused_ab import full_step  # noqa: E402
from gradcache_idle_probe import device_intervals, steps, syncs, trace_events  # noqa: E402
from gradcache_switch_ab import ARMS  # noqa: E402

from bigbatch.bench.common import hardware  # noqa: E402
from bigbatch.bench.gradcache import DualEncoder, _rep  # noqa: E402
from bigbatch.gradcache import GradCache  # noqa: E402


class Marks:
    """Host time stamps and CUDA events, in the order taken (any thread)."""

    def __init__(self) -> None:
        self.on = False
        self.rows: List[tuple] = []

    def take(self, label: str) -> None:
        if not self.on:
            return
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.rows.append((label, time.perf_counter(), e))


def hook_models(marks: Marks, models: Dict[str, torch.nn.Module]) -> list:
    handles = []
    for name, model in models.items():
        def model_pre(mod, args, name=name):
            marks.take(f"{name}.{'fwd' if torch.is_grad_enabled() else 'pass1'}.start")
        handles.append(model.register_forward_pre_hook(model_pre))
        for i, layer in enumerate(model.encoder.layer):
            def pre(mod, args, name=name, i=i):
                marks.take(f"{name}.{'fwd' if torch.is_grad_enabled() else 'pass1'}.L{i}")

            def post(mod, args, out, name=name, i=i):
                t = out[0] if isinstance(out, tuple) else out
                if t.requires_grad:
                    t.register_hook(lambda g: marks.take(f"{name}.bwd.L{i}"))
            handles.append(layer.register_forward_pre_hook(pre))
            handles.append(layer.register_forward_hook(post))

        def emb_post(mod, args, out, name=name):
            if out.requires_grad:
                out.register_hook(lambda g: marks.take(f"{name}.bwd.emb"))
        handles.append(model.embeddings.register_forward_hook(emb_post))
    return handles


class Collections:
    """Python's garbage collections while ``on``: per generation, count and host ms; a mark at each end."""

    def __init__(self, marks: Marks) -> None:
        self.marks, self.on, self.started = marks, False, 0.0
        self.per: Dict[int, list] = {}
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self.started = time.perf_counter()
            return
        got = self.per.setdefault(info["generation"], [0, 0.0])
        got[0] += 1
        got[1] += (time.perf_counter() - self.started) * 1e3
        self.marks.take(f"gc.{info['generation']}")


def gaps(step, min_us: float = 5.0) -> dict:
    """The GPU's idle gaps of one step (a CUDA-only profiler trace: device intervals), with the
    kernel before and after each, summed per (before -> after) pair, and the largest gaps with
    their offset from the step's first device interval (to set beside the marks' ``gpu_ms``)."""
    events, _ = trace_events(step)
    def short(name: str) -> str:
        for junk in ("void ", "at::native::", "(anonymous namespace)::", "vectorized_elementwise_kernel",
                     "unrolled_elementwise_kernel", "at_cuda_detail::", "cudnn_generated_fort_native_"):
            name = name.replace(junk, "")
        return name[:64]

    iv = device_intervals(events, lambda e: short(e["name"]))
    pairs: Dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    found, end, last = [], iv[0][1], iv[0][2]
    for a, b, name, _ in iv[1:]:
        if a - end >= min_us:
            key = f"{last} -> {name}"
            pairs[key][0] += 1
            pairs[key][1] += (a - end) / 1e3
            found.append((round((end - iv[0][0]) / 1e3, 3), round((a - end) / 1e3, 3), key))
        if b > end:
            end, last = b, name
    total = sum(g for _, g, _ in found)
    return {"idle_ms": total, "gaps": len(found), "span_ms": (end - iv[0][0]) / 1e3,
            "by_pair": sorted(([k, v[0], round(v[1], 3)] for k, v in pairs.items()), key=lambda r: -r[2])[:40],
            "largest": sorted(found, key=lambda r: -r[1])[:60]}


def phase(label: str) -> str:
    parts = label.split(".")
    return f"{parts[0]}.{parts[1]}"


def lead_step(step, marks: Marks, collections_: Collections) -> dict:
    torch.cuda.synchronize()
    marks.rows = []
    collections_.per = {}
    marks.on = collections_.on = True
    marks.take("step.start")
    step()
    marks.take("step.end")
    marks.on = collections_.on = False
    torch.cuda.synchronize()
    (_, h0, e0), rows = marks.rows[0], marks.rows
    out = [(label, (h - h0) * 1e3, e0.elapsed_time(e)) for label, h, e in rows]
    per: Dict[str, dict] = collections.OrderedDict()
    for label, host, gpu in out:
        p = per.setdefault(phase(label), {"marks": 0, "min_lead_ms": 1e9, "dry_marks": 0, "host": [host, host], "gpu": [gpu, gpu]})
        p["marks"] += 1
        p["min_lead_ms"] = min(p["min_lead_ms"], gpu - host)
        p["dry_marks"] += gpu - host < 0.1
        p["host"][1], p["gpu"][1] = host, gpu
    for p in per.values():
        p["host_span_ms"] = p["host"][1] - p["host"][0]
        p["gpu_span_ms"] = p["gpu"][1] - p["gpu"][0]
    return {"step_ms": out[-1][2], "issue_ms": out[-1][1], "phases": per, "gc": dict(collections_.per),
            "marks": [[lab, round(h, 3), round(g, 3), round(g - h, 3)] for lab, h, g in out]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--arms", nargs="+", default=["pytorch_norms", "norm_kernel"], choices=sorted(ARMS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gaps", action="store_true", help="also the idle gaps of one profiled step per arm (see gaps())")
    args = p.parse_args()
    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    marks = Marks()
    collections_ = Collections(marks)
    hook_models(marks, {"q": setup.mq, "p": setup.mp})

    def loss_fn(q, k):
        marks.take("loss.start")
        out = setup.loss_fn(q, k)
        marks.take("loss.end")
        return out
    res = {"hardware": hardware(), "rows": []}
    for b in args.batches:
        qi, pi, full = full_step(setup, b, dev)
        bb = GradCache([setup.mq, setup.mp], memory_budget="16GiB", loss_fn=loss_fn, get_rep_fn=_rep,
                       autocast_dtype=torch.bfloat16)
        steps(full, 2)
        full_ms, _ = steps(full, 5)
        row = {"batch": b, "full_ms": statistics.median(full_ms)}
        for name in args.arms:
            with ARMS[name]():
                steps(lambda: bb(qi, pi), 2)
                ms, issue = steps(lambda: bb(qi, pi), 5)
                runs = [lead_step(lambda: bb(qi, pi), marks, collections_) for _ in range(args.repeat)]
                sync = syncs(lambda: bb(qi, pi))
                gap = gaps(lambda: bb(qi, pi)) if args.gaps else None
            best = min(runs, key=lambda r: r["step_ms"])
            row[name] = {"median_ms": statistics.median(ms), "issue_median_ms": statistics.median(issue),
                         "marked_step_ms": [r["step_ms"] for r in runs], "syncs": sync, "gc_per_run": [r["gc"] for r in runs], "gaps": gap,
                         "plan": [list(r) for r in bb.last_chunk_rows], **best}
            print(f"B={b} {name}: {row[name]['median_ms']:.1f} ms (marked {best['step_ms']:.1f}), syncs {sync['count']} "
                  f"{sync['where']}, gc per marked step {[r['gc'] for r in runs]}", flush=True)
            if gap:
                print(f"   idle {gap['idle_ms']:.1f} ms in {gap['gaps']} gaps; span {gap['span_ms']:.1f}", flush=True)
                for k, n, ms in gap["by_pair"][:25]:
                    print(f"      {ms:7.2f} ms {n:4d}x  {k}", flush=True)
            for ph, v in best["phases"].items():
                print(f"   {ph:10s} marks {v['marks']:4d} dry {v['dry_marks']:4d} min lead {v['min_lead_ms']:7.2f} "
                      f"host span {v['host_span_ms']:7.1f} gpu span {v['gpu_span_ms']:7.1f}", flush=True)
        res["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
