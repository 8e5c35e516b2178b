"""A/B: per-chunk gradient accumulation fused (``torch._foreach_add_``) vs autograd's one add per
parameter, in a ``bigbatch.GradCache`` step (one GPU).

The setting of ``bigbatch.bench.gradcache`` (two BERT-base encoders, bf16 autocast, queries 32
tokens, passages 128, 16 GiB budget, ``.grad`` pre-allocated). Per batch size: the full-batch
step and the cached step with the fused path on and off, interleaved over several rounds
(CUDA-event medians); then, per variant, one profiled call: GPU busy time (union of kernel
intervals), idle time inside the step, kernel count and the host's issue time.

    python experiments/gradcache_fused_ab.py --out /tmp/gradcache_fused_ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from bigbatch.bench.common import hardware, matmul_tflops
from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep
from bigbatch.gradcache import GradCache, accumulate

from gradcache_idle_probe import busy


def once_ms(fn) -> float:
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def interleaved(variants, rounds: int, repeat: int, label: str):
    """CUDA-event times of each variant, interleaved: ``rounds`` x (each variant ``repeat`` times),
    after one warm-up call of each. Returns {name: {"median_ms", "times_ms"}}; prints the running
    medians after each round."""
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    for r in range(rounds):
        for name, fn in variants.items():
            for _ in range(repeat):
                times[name].append(once_ms(fn))
        print(f"{label} round {r}: " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in times.items()), flush=True)
    return {k: {"median_ms": statistics.median(v), "times_ms": v} for k, v in times.items()}


def record(out, row, variants, path: str) -> None:
    """Print the row's summary (without the per-variant timings), append it, rewrite the JSON."""
    print(json.dumps({k: v for k, v in row.items() if k not in variants}), flush=True)
    out["rows"].append(row)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def full_step(setup, b: int, device):
    """The benchmark's inputs at batch ``b`` and its full-batch step: (query inputs, passage inputs, step)."""
    qi = _inputs(b, 32, setup.cfg.vocab_size, device, 10 + b)
    pi = _inputs(b, 128, setup.cfg.vocab_size, device, 20 + b)

    def full():
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            l = setup.loss_fn(_rep(setup.mq(**qi)), _rep(setup.mp(**pi)))
        l.backward()

    return qi, pi, full


def probe_main():
    """``--out`` and ``--batch`` (default 2,048) parsed, and :func:`cached_setup` at that batch on
    CUDA: (args, DualEncoder, query inputs, passage inputs, bigbatch.GradCache)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=2048)
    args = p.parse_args()
    setup, qi, pi, _, bb = cached_setup(args.batch, torch.device("cuda"))
    return args, setup, qi, pi, bb


def cached_setup(b: int, device):
    """The benchmark's setting at batch ``b``: (DualEncoder, query inputs, passage inputs, full-batch
    step, bigbatch.GradCache at a 16 GiB budget)."""
    setup = DualEncoder(device)
    qi, pi, full = full_step(setup, b, device)
    bb = GradCache([setup.mq, setup.mp], memory_budget="16GiB", loss_fn=setup.loss_fn,
                   get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
    return setup, qi, pi, full, bb


def switched(gc, switch, on: bool, *inputs):
    """A cached step ``gc(*inputs)`` run with the library's module switch ``switch.ENABLED = on``
    (accumulate, norms), set back to its value before afterwards: one side of an A/B."""
    def step():
        with switch_set(switch, on):
            gc(*inputs)
    return step


@contextlib.contextmanager
def switch_set(switch, on: bool):
    """The library's module switch ``switch.ENABLED`` (accumulate, norms) set to ``on`` for the
    block, then back to its value before."""
    saved, switch.ENABLED = switch.ENABLED, on
    try:
        yield
    finally:
        switch.ENABLED = saved


def ab_setup(name: str, batches, rounds: int, repeat: int, budget: bool = False):
    """The common start of these A/B experiments: their command line (batches, interleaved
    rounds x repeats, output path), the benchmark's dual encoder on the GPU, and the result dict.
    Returns (args, device, setup, out)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=batches)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--repeat", type=int, default=repeat)
    if budget:
        ap.add_argument("--budget", default="16GiB")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    setup = DualEncoder(device)
    out = {"experiment": name, "hardware": hardware(), "args": vars(args),
           "bf16_matmul_tflops": matmul_tflops(), "rows": []}
    return args, device, setup, out


def main() -> None:
    args, device, setup, out = ab_setup("gradcache_fused_ab", [1024, 2048], 3, 3, budget=True)
    mq, mp, loss_fn = setup.mq, setup.mp, setup.loss_fn
    gc = GradCache([mq, mp], memory_budget=args.budget, loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)

    for b in args.batches:
        qi, pi, full = full_step(setup, b, device)

        variants = {"full": full, "fused": switched(gc, accumulate, True, qi, pi), "plain": switched(gc, accumulate, False, qi, pi)}
        timed = interleaved(variants, args.rounds, args.repeat, f"B={b}")
        row = {"batch": b, "chunk_rows": [list(x) for x in gc.last_chunk_rows], "kept_rows": list(gc.last_kept_rows)}
        for name, fn in variants.items():
            row[name] = timed[name]
            t0 = time.perf_counter()
            fn()
            row[name]["issue_ms"] = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            prof = busy(fn)
            row[name]["profiled"] = {k: v for k, v in prof.items() if k != "top"}
        for name in ("fused", "plain"):
            row[f"{name}_over_full"] = row[name]["median_ms"] / row["full"]["median_ms"]
        record(out, row, variants, args.out)


if __name__ == "__main__":
    main()
