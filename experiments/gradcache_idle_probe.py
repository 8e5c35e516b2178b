"""Is a chunked BERT step slower because the GPU idles (host syncs, CPU launch overhead) or because
its kernels are slower? (one GPU)

The setting of ``bigbatch.bench.gradcache`` (BERT-base, bf16 autocast, passages 128 tokens, queries
32). For each variant: CUDA-event time, the host's issue time (until the call returns, before the
sync), GPU busy time (the union of kernel / copy intervals in a CUDA-only profiler trace) and the
host syncs one call makes (``torch.cuda.set_sync_debug_mode``), with the Python lines that caused
them. Variants: the passage encoder's forward + backward and no-grad forward, whole batch vs
256-row chunks, with and without an (all-ones) attention mask -- Hugging Face models read the mask
back to the host once per forward; the full step and ``bigbatch.GradCache`` at 16 GiB; and the
bound that CUDA-graph replay of a chunk's forward + backward would give.

    python experiments/gradcache_idle_probe.py --out /tmp/gradcache_idle_probe.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
import traceback
import warnings

import torch

from bigbatch.bench.common import hardware
from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep
from bigbatch.gradcache import GradCache
from bigbatch.gradcache.chunking import split_batch


def steps(fn, n):
    """CUDA-event times and host issue times (until the call returns) of ``n`` calls, in ms."""
    times, issue = [], []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        fn()
        issue.append((time.perf_counter() - t0) * 1e3)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return times, issue


def timed(fn, repeat=3):
    fn()
    torch.cuda.synchronize()
    times, issue = steps(fn, repeat)
    return {"ms": statistics.median(times), "issue_ms": statistics.median(issue)}


def trace_events(fn, cpu: bool = False) -> list:
    """The chrome-trace events of one profiled call of ``fn`` (after one unprofiled call), CUDA
    activity only unless ``cpu``; and the call's wall time in ms."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return events, wall


def device_intervals(events: list, name=lambda e: e["name"]) -> list:
    """The trace's device intervals (kernels, copies, memsets) as sorted ``(start, end, name(event),
    event)``, in microseconds."""
    return sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), name(e), e) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda r: r[:2])


def busy(fn):
    """Wall time and GPU busy time (union of device intervals) of one call, CUDA-only trace."""
    events, wall = trace_events(fn)
    iv, per = [], collections.Counter()
    for a, b, name, _ in device_intervals(events, lambda e: e["name"][:90]):
        iv.append((a, b))
        per[name] += (b - a) / 1e3
    iv.sort()
    union, end = 0.0, None
    for a, b in iv:
        if end is None or a > end:
            union += b - a
            end = b
        elif b > end:
            union += b - end
            end = b
    span = (iv[-1][1] - iv[0][0]) / 1e3 if iv else 0.0
    return {"wall_ms": wall, "busy_ms": union / 1e3, "span_ms": span, "idle_in_span_ms": span - union / 1e3,
            "kernels": len(iv), "top": [[n, round(ms, 3)] for n, ms in per.most_common(40)]}


def syncs(fn):
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in rec)
    return {"count": len(rec), "where": where.most_common(8), "first": str(rec[0].message)[:160] if rec else None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--b", type=int, nargs="+", default=[2048, 1024])
    p.add_argument("--graph-only", action="store_true",
                   help="only the CUDA-graph bound and its eager baselines (no masks, passages)")
    args = p.parse_args()
    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    mq, mp, cfg, loss_fn = setup.mq, setup.mp, setup.cfg, setup.loss_fn

    amp = dict(device_type="cuda", dtype=torch.bfloat16)
    res = {"hardware": hardware(), "rows": [], "errors": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def run(row, name, fn, profile=True):
        try:
            r = timed(fn)
            if profile:
                r["busy"] = busy(fn)
                r["syncs"] = syncs(fn)
            row[name] = r
            print(name, {k: v for k, v in r.items() if k != "busy"}, {k: v for k, v in r.get("busy", {}).items() if k != "top"}, flush=True)
        except Exception as exc:  # recorded, the probe goes on
            res["errors"][f"{row['batch']}:{name}"] = traceback.format_exc()[-1500:]
            print("ERROR", name, repr(exc), flush=True)
        save()

    for b in args.b:
        row = {"batch": b}
        res["rows"].append(row)
        qi, pi = _inputs(b, 32, cfg.vocab_size, dev, 1), _inputs(b, 128, cfg.vocab_size, dev, 2)
        qn, pn = {"input_ids": qi["input_ids"]}, {"input_ids": pi["input_ids"]}
        for mask, inp in (("mask", pi), ("nomask", pn)):
            if args.graph_only and mask == "mask":
                continue
            for c in (b, 256):
                chunks = split_batch(inp, c)

                def fwdbwd(chunks=chunks):
                    for x in chunks:
                        with torch.autocast(**amp):
                            r = _rep(mp(**x))
                        r.float().sum().backward()

                def nograd(chunks=chunks):
                    with torch.no_grad(), torch.autocast(**amp):
                        for x in chunks:
                            _rep(mp(**x))

                run(row, f"p_fwdbwd_c{c}_{mask}", fwdbwd, profile=(b == args.b[0]))
                run(row, f"p_nograd_c{c}_{mask}", nograd, profile=False)
        for mask, (q, k) in (("mask", (qi, pi)), ("nomask", (qn, pn))) if not args.graph_only else ():
            def full(q=q, k=k):
                with torch.autocast(**amp):
                    loss = loss_fn(_rep(mq(**q)), _rep(mp(**k)))
                loss.backward()

            gc = GradCache([mq, mp], memory_budget="16GiB", loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
            run(row, f"full_{mask}", full)
            run(row, f"gc16_{mask}", lambda gc=gc, q=q, k=k: gc(q, k))
            if f"gc16_{mask}" in row:
                row[f"gc16_{mask}"]["chunk_sizes"] = list(gc.last_chunk_sizes)
                row[f"gc16_{mask}"]["kept_rows"] = list(gc.last_kept_rows)
                if f"full_{mask}" in row:
                    row[f"gc16_{mask}"]["over_full"] = row[f"gc16_{mask}"]["ms"] / row[f"full_{mask}"]["ms"]
            del gc
            save()

        if b == args.b[0]:
            # the bound for CUDA-graph replay: the passage encoder's 256-row chunk, forward + backward
            # captured once (no mask: capture cannot read the mask back), replayed per chunk
            try:
                class Enc(torch.nn.Module):
                    def __init__(self, m):
                        super().__init__()
                        self.m = m

                    def forward(self, ids):
                        with torch.autocast(cache_enabled=False, **amp):
                            return _rep(self.m(input_ids=ids)).float()

                enc = Enc(mp)
                chunks = split_batch(pn, 256)
                static = chunks[0]["input_ids"].clone()
                # the pooler's parameters take no part in the [CLS] representation
                graphed = torch.cuda.make_graphed_callables(enc, (static,), allow_unused_input=True)

                def g_fwdbwd():
                    for x in chunks:
                        graphed(x["input_ids"]).sum().backward()

                run(row, "p_fwdbwd_c256_graphed", g_fwdbwd, profile=True)
            except Exception as exc:
                res["errors"]["graphed"] = traceback.format_exc()[-2500:]
                print("ERROR graphed", repr(exc), flush=True)
            save()
    save()


if __name__ == "__main__":
    main()
