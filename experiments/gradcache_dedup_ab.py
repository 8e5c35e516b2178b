"""A/B of ``dedup_saved`` (each saved activation held once: ``gradcache/saved.py``) at a 16 GiB
budget on one GPU, in the setting of ``bigbatch.bench.gradcache``.

1. What a passage chunk's forward saves per row (CUDA allocator bytes between forward and backward,
   64 rows x 128 tokens, bf16 autocast), with and without dedup, and which saved-tensor kinds.
2. Gradients: one GradCache step (fixed chunks, the same seed) with dedup against without, and
   without against itself (attention backward kernels accumulate with atomics: not bitwise).
3. The probe's memory line against measured forward + backward peaks at larger chunks (queries
   and passages, dedup on and off): is the plan's extrapolation from 16 and 48 rows right?
4. CUDA-event times in blocks (each variant: one warm-up call after the switch, then ``repeat``
   calls; ``rounds`` rounds): full step, GradCache(dedup_saved=False), GradCache(dedup_saved=True),
   with their chunk rows, probed memory lines and peak memory. Blocks, not call-by-call
   interleaving: at B = 2048 the full step caches ~125 GiB in the allocator, and a switch to a
   variant with other block sizes makes the allocator free and re-allocate (seconds of outliers).

    cd experiments && python gradcache_dedup_ab.py --out ../benchmarks/results/probes/gradcache_dedup_ab_h200.json
"""

from __future__ import annotations

import collections

import torch

from bigbatch.bench.gradcache import _inputs, _rep
from bigbatch.gradcache import GradCache
from bigbatch.gradcache import saved as saved_mod

from gradcache_chunk_shape_probe import GIB, peak_gib
from gradcache_fused_ab import ab_setup, full_step, once_ms, record
from bigbatch.gradcache import budget as budget_mod


def blocks(variants, rounds: int, repeat: int, label: str):
    import statistics

    times = {k: [] for k in variants}
    for r in range(rounds):
        for name, fn in variants.items():
            fn()  # warm-up after the switch
            times[name] += [once_ms(fn) for _ in range(repeat)]
        print(f"{label} round {r}: " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in times.items()), flush=True)
    return {k: {"median_ms": statistics.median(v), "times_ms": v} for k, v in times.items()}


def line_check(model, seq: int, rows, device):
    """Measured (peak, held) GiB of one chunk's forward + backward, dedup off and on, per row count."""
    params = [p for p in model.parameters() if p.requires_grad]
    amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    out = {}
    for dedup in (False, True):
        for c in rows:
            x = _inputs(c, seq, model.config.vocab_size, device, 5)
            budget_mod._measure(model, x, _rep, amp, params, device, True, dedup)  # warm
            peak, act, _ = budget_mod._measure(model, x, _rep, amp, params, device, True, dedup)
            out[f"{dedup}/{c}"] = (round(peak / GIB, 4), round(act / GIB, 4))
    return out


def saved_per_row(model, device, dedup: bool, rows: int = 64):
    """(MiB per row held between forward and backward, kinds of packed objects)."""
    inp = _inputs(rows, 128, model.config.vocab_size, device, 3)
    kinds = collections.Counter()
    pack = saved_mod.SavedOnce._pack

    def counting(self, t):
        r = pack(self, t)
        kinds[type(r).__name__] += 1
        return r

    saved_mod.SavedOnce._pack = counting
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16), saved_mod.SavedOnce(enabled=dedup):
            rep = _rep(model(**inp))
        held = torch.cuda.memory_allocated() - base
        rep.float().sum().backward()
    finally:
        saved_mod.SavedOnce._pack = pack
    model.zero_grad(set_to_none=False)
    return held / rows / 2**20, dict(kinds)


def main() -> None:
    args, device, setup, out = ab_setup("gradcache_dedup_ab", [2048, 1024], 2, 4)
    out["saved_mib_per_row"] = {}
    for dedup in (False, True):
        out["saved_mib_per_row"][str(dedup)] = saved_per_row(setup.mp, device, dedup)
    print("saved per row", out["saved_mib_per_row"], flush=True)

    kw = dict(loss_fn=setup.loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
    qi, pi = _inputs(256, 32, setup.cfg.vocab_size, device, 7), _inputs(256, 128, setup.cfg.vocab_size, device, 8)
    grads = {}
    for name, dedup in (("plain", False), ("plain_again", False), ("dedup", True)):
        for p in setup.params:
            p.grad.zero_()
        torch.manual_seed(11)
        GradCache([setup.mq, setup.mp], chunk_sizes=[128, 96], dedup_saved=dedup, **kw)(qi, pi)
        grads[name] = [p.grad.clone() for p in setup.params]
    # attention backward kernels accumulate with atomics: two plain runs differ too; the baseline
    for name in ("plain_again", "dedup"):
        out[f"{name}_vs_plain"] = {
            "bitwise_equal": all(torch.equal(a, b) for a, b in zip(grads["plain"], grads[name])),
            "max_rel_diff": max(((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30)).item()
                                for a, b in zip(grads["plain"], grads[name]))}
    print({k: v for k, v in out.items() if k.endswith("_vs_plain")}, flush=True)
    del grads

    out["line_check"] = {"query": line_check(setup.mq, 32, [16, 48, 256, 1024, 1600], device),
                         "passage": line_check(setup.mp, 128, [16, 48, 128, 256, 360], device)}
    print("line check", out["line_check"], flush=True)

    plain = GradCache([setup.mq, setup.mp], memory_budget="16GiB", dedup_saved=False, **kw)
    dedup = GradCache([setup.mq, setup.mp], memory_budget="16GiB", dedup_saved=True, **kw)
    for b in args.batches:
        qi, pi, full = full_step(setup, b, device)
        variants = {"full": full, "plain": lambda: plain(qi, pi), "dedup": lambda: dedup(qi, pi)}
        timed = blocks(variants, args.rounds, args.repeat, f"B={b}")
        row = {"batch": b}
        for name in variants:
            row[name] = timed[name]
            row[f"{name}_over_full"] = timed[name]["median_ms"] / timed["full"]["median_ms"]
        for name, gcache in (("plain", plain), ("dedup", dedup)):
            row[name].update(chunk_rows=[list(r) for r in gcache.last_chunk_rows],
                             kept_rows=list(gcache.last_kept_rows), peak_total_gib=peak_gib(variants[name]),
                             chunk_cost_mib=[{k: round(v / 2**20, 3) for k, v in vars(c).items()}
                                             for c in gcache._prober._cache.values()])
        record(out, row, variants, args.out)
    print("budget GiB", 16, "base", torch.cuda.memory_allocated() / GIB)


if __name__ == "__main__":
    main()
