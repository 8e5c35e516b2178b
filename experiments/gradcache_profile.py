"""Where does a gradient-caching step lose time against the full-batch step? (one GPU)

The setting of ``bigbatch.bench.gradcache`` (two BERT-base encoders, bf16 autocast, queries 32
and passages 128 tokens). Times, in one process: the full step; bigbatch.GradCache with the
16 GiB budget and with fixed chunk sizes; the encoder pieces alone (no-grad forward and
forward + backward, whole batch vs chunks). Then a torch.profiler trace of one full step and
one cached step: GPU kernel time vs wall time (is the GPU idle?) and the top kernels.

    python experiments/gradcache_profile.py --b 2048 --out /tmp/gradcache_profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bigbatch.bench.common import cuda_time_ms, hardware
from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep
from bigbatch.gradcache import GradCache
from bigbatch.gradcache.chunking import split_batch


def timed(fn, repeat=3):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = statistics.median(cuda_time_ms(fn, warmup=1, repeat=repeat))
    return {"ms": t, "extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}


def kernel_time(fn):
    """(kernel ms, wall ms, top kernels) of one call under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    total = 0.0
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        if dev > 0:
            total += dev / 1e3
            rows.append((dev / 1e3, e.key, e.count))
    rows.sort(reverse=True)
    return {"kernel_ms": total, "wall_ms": wall, "top": [{"ms": r[0], "name": r[1][:90], "count": r[2]} for r in rows[:15]]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--b", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    mq, mp, cfg, loss_fn = setup.mq, setup.mp, setup.cfg, setup.loss_fn

    amp = dict(device_type="cuda", dtype=torch.bfloat16)
    res = {"hardware": hardware(), "rows": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for b in args.b:
        qi, pi = _inputs(b, 32, cfg.vocab_size, dev, 1), _inputs(b, 128, cfg.vocab_size, dev, 2)
        row = {"batch": b}

        def full():
            with torch.autocast(**amp):
                loss = loss_fn(_rep(mq(**qi)), _rep(mp(**pi)))
            loss.backward()

        row["full"] = timed(full)
        print(b, "full", row["full"], flush=True)
        gcs = {
            "budget16": GradCache([mq, mp], memory_budget="16GiB", loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16),
            "chunks_b_512": GradCache([mq, mp], chunk_sizes=[b, 512], loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16),
            "chunks_b_256": GradCache([mq, mp], chunk_sizes=[b, 256], loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16),
            "chunks_b_b": GradCache([mq, mp], chunk_sizes=[b, b], loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16),
        }
        for name, gc in gcs.items():
            row[name] = timed(lambda: gc(qi, pi))
            row[name]["chunk_sizes"] = list(gc.last_chunk_sizes)
            row[name]["kept_rows"] = list(gc.last_kept_rows)
            row[name]["over_full"] = row[name]["ms"] / row["full"]["ms"]
            print(b, name, row[name], flush=True)
            save()
        pieces = {}
        for c in (b, 512, 292, 256):
            chunks = split_batch(pi, c)

            def nograd():
                with torch.no_grad(), torch.autocast(**amp):
                    for x in chunks:
                        _rep(mp(**x))

            def fwdbwd():
                for x in chunks:
                    with torch.autocast(**amp):
                        r = _rep(mp(**x))
                    r.float().sum().backward()

            pieces[f"p_nograd_chunk{c}"] = timed(nograd)["ms"]
            pieces[f"p_fwdbwd_chunk{c}"] = timed(fwdbwd)["ms"]
        row["pieces"] = pieces
        print(b, pieces, flush=True)
        row["profile_full"] = kernel_time(full)
        gc = gcs["budget16"]
        row["profile_budget16"] = kernel_time(lambda: gc(qi, pi))
        print(b, "profile", {k: (row[k]["kernel_ms"], row[k]["wall_ms"]) for k in ("profile_full", "profile_budget16")}, flush=True)
        res["rows"].append(row)
        save()
        del gcs, gc


if __name__ == "__main__":
    main()
