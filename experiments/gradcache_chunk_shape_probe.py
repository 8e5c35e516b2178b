"""How do the chunk rows and the reading of the memory budget change a gradient-caching step? (one GPU)

The setting of ``bigbatch.bench.gradcache`` (two BERT-base encoders, bf16 autocast, queries 32
tokens, passages 128, ``.grad`` pre-allocated).

Part 1, per batch size: the full-batch step and ``bigbatch.GradCache`` interleaved (CUDA-event
medians), with the budget read three ways:

* ``added``: 16 GiB on top of what is allocated when the step starts (the budget before
  session 5; emulated by passing 16 GiB + the bytes allocated now);
* ``total``: 16 GiB for the device's whole allocation (weights and ``.grad`` included);
* ``total_256``: the same budget with fixed chunks, 1,024 query rows and 256 passage rows.

Each with its chunk rows, kept rows, and the step's peak allocation. One profiled call of
``total`` gives the GPU busy and idle time.

Part 2: the encoders alone, forward + backward and no-grad forward, per chunk size, as ms per
2,048 rows (the chunks are consecutive full chunks of one 2,048-row batch): is a chunk size
slow for its shape, beyond the cost of having more chunks?

    python experiments/gradcache_chunk_shape_probe.py --out /tmp/gradcache_chunk_shape.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bigbatch.bench.common import hardware, matmul_tflops
from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep
from bigbatch.gradcache import GradCache
from bigbatch.gradcache.accumulate import GradAccumulation
from bigbatch.gradcache.chunking import split_batch

from gradcache_fused_ab import full_step, interleaved, once_ms, record
from gradcache_idle_probe import busy

GIB = 2**30


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / GIB


def per_2048_rows(fn, rows: int, repeat: int = 3) -> float:
    fn()
    return statistics.median(once_ms(fn) for _ in range(repeat)) * 2048 / rows


def encoder_sweep(model, inp, sizes, amp):
    """{size: {"fwdbwd": ms per 2048 rows, "nograd": ...}} for chunks of ``size`` rows of ``inp``."""
    out = {}
    for c in sizes:
        chunks = [x for x in split_batch(inp, c) if x["input_ids"].shape[0] == c]  # full chunks only
        rows = sum(x["input_ids"].shape[0] for x in chunks)
        grads = [torch.randn(x["input_ids"].shape[0], 768, device="cuda") for x in chunks]

        def fwdbwd():
            with torch.autocast(**amp):
                for x, g in zip(chunks, grads):
                    r = _rep(model(**x))
                    with torch.autocast(device_type="cuda", enabled=False), GradAccumulation(model).chunk():
                        torch.autograd.backward(r, g.to(r.dtype))

        def nograd():
            with torch.no_grad(), torch.autocast(**amp):
                for x in chunks:
                    _rep(model(**x))

        out[c] = {"chunks": len(chunks), "rows": rows, "fwdbwd": per_2048_rows(fwdbwd, rows), "nograd": per_2048_rows(nograd, rows)}
        print(f"  c={c}: {out[c]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[2048, 1024, 512])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--p-sizes", type=int, nargs="+", default=[192, 224, 240, 248, 256, 264, 272, 280, 288, 292, 304, 320, 384, 512])
    ap.add_argument("--q-sizes", type=int, nargs="+", default=[768, 896, 960, 1000, 1024, 1056, 1100, 1152, 1171, 1280])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    setup = DualEncoder(device)
    mq, mp, loss_fn = setup.mq, setup.mp, setup.loss_fn
    amp = dict(device_type="cuda", dtype=torch.bfloat16)
    out = {"experiment": "gradcache_chunk_shape_probe", "hardware": hardware(), "args": vars(args),
           "bf16_matmul_tflops": matmul_tflops(), "rows": []}
    base = torch.cuda.memory_allocated()
    kw = dict(loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
    caches = {
        "added": GradCache([mq, mp], memory_budget=16 * GIB + base, **kw),
        "total": GradCache([mq, mp], memory_budget="16GiB", **kw),
        "total_256": GradCache([mq, mp], chunk_sizes=[1024, 256], memory_budget="16GiB", **kw),
    }
    for b in args.batches:
        qi, pi, full = full_step(setup, b, device)
        variants = {"full": full, **{k: (lambda gc=gc: gc(qi, pi)) for k, gc in caches.items()}}
        timed = interleaved(variants, args.rounds, args.repeat, f"B={b}")
        row = {"batch": b, "base_gib": base / GIB}
        for name, fn in variants.items():
            row[name] = timed[name]
            if name != "full":
                gc = caches[name]
                row[name].update(chunk_rows=[list(r) for r in gc.last_chunk_rows], kept_rows=list(gc.last_kept_rows),
                                 peak_total_gib=peak_gib(fn), over_full=row[name]["median_ms"] / timed["full"]["median_ms"])
        if b == args.batches[0]:
            prof = busy(variants["total"])
            row["total"]["profiled"] = {k: v for k, v in prof.items() if k != "top"}
        record(out, row, variants, args.out)

    big = 2048
    qi, pi = _inputs(big, 32, setup.cfg.vocab_size, device, 1), _inputs(big, 128, setup.cfg.vocab_size, device, 2)
    print("passage sweep", flush=True)
    out["passage_sweep"] = encoder_sweep(mp, pi, args.p_sizes, amp)
    save(out, args.out)
    print("query sweep", flush=True)
    out["query_sweep"] = encoder_sweep(mq, qi, args.q_sizes, amp)
    save(out, args.out)


def save(out, path: str) -> None:
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
