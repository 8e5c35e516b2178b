"""Probe: LayerNorm's backward and the bias-gradient reductions on gradient caching's chunk sizes,
and what the one-pass LayerNorm backward (``bigbatch.gradcache.norm_kernel``) does to a cached step.

A. LayerNorm backward of (rows, 768) fp32 (x, dy; the benchmark's autocast case) and bf16: PyTorch's
   ``native_layer_norm_backward`` with all three outputs, with dx only, and the Triton kernel in a few
   tile configurations; time per call and effective bandwidth (bytes read + written / time), and the
   kernel's gradients against PyTorch's.
B. Bias gradient ``g.sum(0)`` of (rows, N) bf16, N = 768 / 3072, against a gemv (``ones @ g``).
C. The benchmark's dual encoder (``bigbatch.bench.gradcache``): full step, GradCache, and GradCache with
   the kernel off (``norms.ENABLED = False``), interleaved; the gradients with the kernel against
   those without (same seed, plan made first), and a second run without as the noise floor.

    python experiments/gradcache_norm_probe.py --out /tmp/norm_probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch

from bigbatch.bench.common import hardware, matmul_tflops
from bigbatch.gradcache import norm_kernel, norms


def loop_ms(fn, calls: int = 20, reps: int = 9) -> float:
    """GPU time per call: median over ``reps`` of (time of ``calls`` back-to-back calls) / calls,
    CUDA events, the calls queued behind a ~20 ms sleep kernel so that the host's launch cost
    (Triton's launcher, Python) is not what is timed."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(40_000_000)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / calls)
    return statistics.median(out)


def host_us(fn, calls: int = 50) -> float:
    """Host time per call (launch cost), GPU not waited for."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def part_a(rows_list, out):
    n = 768
    base_plan = norm_kernel._launch_plan
    for dtype in (torch.float32, torch.bfloat16):
        for rows in rows_list:
            x = torch.randn(rows, n, device="cuda", dtype=dtype) * 2 + 0.5
            dy = torch.randn(rows, n, device="cuda", dtype=dtype)
            w = torch.randn(n, device="cuda", dtype=dtype)
            b = torch.randn(n, device="cuda", dtype=dtype)
            _, mean, rstd = torch.native_layer_norm(x, [n], w, b, 1e-12)
            row = {"dtype": str(dtype), "rows": rows, "n": n}
            el = x.element_size()
            row["torch_full_ms"] = loop_ms(lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, True, True]))
            row["torch_dx_ms"] = loop_ms(lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, False, False]))
            ref = torch.ops.aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, True, True])
            variants = {}
            for block_m in (2, 4, 8, 16):
                for per_sm in (2, 4, 8):
                    norm_kernel._launch_plan = functools.partial(base_plan, block_m=block_m, per_sm=per_sm)
                    try:
                        ms = loop_ms(lambda: norm_kernel.layer_norm_backward(x, dy, w, 1e-12, True, True, True))
                    except Exception as exc:  # a configuration out of resources
                        variants[f"m{block_m}_p{per_sm}"] = repr(exc)[:120]
                        continue
                    variants[f"m{block_m}_p{per_sm}"] = ms
            norm_kernel._launch_plan = base_plan
            row["ours_default_ms"] = loop_ms(lambda: norm_kernel.layer_norm_backward(x, dy, w, 1e-12, True, True, True))
            row["ours_host_us"] = host_us(lambda: norm_kernel.layer_norm_backward(x, dy, w, 1e-12, True, True, True))
            row["torch_full_host_us"] = host_us(lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [n], mean, rstd, w, b, [True, True, True]))
            mine = norm_kernel.layer_norm_backward(x, dy, w, 1e-12, True, True, True)
            mine = (mine[0], mine[1].to(dtype), mine[2].to(dtype))
            row["rel_err_vs_torch"] = [((a.float() - r.float()).norm() / r.float().norm()).item() for a, r in zip(mine, ref)]
            row["variants_ms"] = variants
            moved = rows * n * 3 * el  # read x, dy; write dx
            row["gbps"] = {k: moved / (row[k] * 1e-3) / 1e9 for k in ("torch_full_ms", "torch_dx_ms", "ours_default_ms")}
            best = min((v, k) for k, v in variants.items() if isinstance(v, float))
            row["best_variant"] = best[1]
            row["best_variant_ms"] = best[0]
            print(json.dumps({k: v for k, v in row.items() if k != "variants_ms"}), flush=True)
            out["ln"].append(row)


def part_b(rows_list, out):
    for n in (768, 3072):
        for rows in rows_list:
            g = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
            ones = torch.ones(1, rows, device="cuda", dtype=torch.bfloat16)
            row = {"rows": rows, "n": n, "sum0_ms": loop_ms(lambda: g.sum(0)), "gemv_ms": loop_ms(lambda: ones @ g)}
            row["sum0_gbps"] = rows * n * 2 / (row["sum0_ms"] * 1e-3) / 1e9
            row["gemv_gbps"] = rows * n * 2 / (row["gemv_ms"] * 1e-3) / 1e9
            print(json.dumps(row), flush=True)
            out["bias"].append(row)


def part_c(batches, rounds, repeat, out):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from gradcache_fused_ab import full_step, interleaved, switched

    from bigbatch.bench.gradcache import DualEncoder, _rep
    from bigbatch.gradcache import GradCache

    device = torch.device("cuda")
    setup = DualEncoder(device)
    gc = GradCache([setup.mq, setup.mp], memory_budget="16GiB", loss_fn=setup.loss_fn, get_rep_fn=_rep,
                   autocast_dtype=torch.bfloat16)

    def grads():
        return torch.cat([t.grad.float().flatten() for t in setup.params]).cpu()  # (held on the CPU: memory on the GPU sets the plan)

    for b in batches:
        qi, pi, full = full_step(setup, b, device)

        def cached(on: bool):
            return switched(gc, norms, on, qi, pi)

        variants = {"full": full, "gradcache": cached(False), "gradcache_kernel": cached(True)}
        timed = interleaved(variants, rounds, repeat, f"B={b}")
        # after the timed calls: the planner has stopped measuring chunks (its measurements draw
        # random numbers), so two calls from one seed draw the same dropout masks
        got = {}
        for name, on in (("plain", False), ("kernel", True), ("plain_again", False)):
            for t in setup.params:
                t.grad.zero_()
            torch.manual_seed(3)
            cached(on)()
            got[name] = grads()
        check = {k: ((got[k] - got["plain"]).norm() / got["plain"].norm()).item() for k in ("kernel", "plain_again")}
        del got
        row = {"batch": b, "grad_rel_diff_vs_plain": check, "chunk_rows": [list(x) for x in gc.last_chunk_rows],
               "kept_rows": list(gc.last_kept_rows)}
        for k, v in timed.items():
            row[k] = v
        row["ratio_plain"] = timed["gradcache"]["median_ms"] / timed["full"]["median_ms"]
        row["ratio_kernel"] = timed["gradcache_kernel"]["median_ms"] / timed["full"]["median_ms"]
        print(json.dumps({k: v for k, v in row.items() if k not in variants}), flush=True)
        out["steps"].append(row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[16384, 32768, 65536, 262144])
    ap.add_argument("--batches", type=int, nargs="*", default=[1024, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--parts", default="abc")
    args = ap.parse_args()
    out = {"experiment": "gradcache_norm_probe", "hardware": hardware(), "args": vars(args),
           "bf16_matmul_tflops": matmul_tflops(), "ln": [], "bias": [], "steps": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    if "a" in args.parts:
        part_a(args.rows, out)
        save()
    if "b" in args.parts:
        part_b(args.rows, out)
        save()
    if "c" in args.parts:
        part_c(args.batches, args.rounds, args.repeat, out)
        save()


if __name__ == "__main__":
    main()
