"""Benchmark: gradient caching for a BERT-base dual encoder, side by side with a full-batch step
and the public GradCache (luyug's ``gradcache`` package), in one process.

Query encoder and passage encoder: ``BertModel(BertConfig())`` (random weights, dropout on),
queries 32 tokens, passages 128, bf16 autocast, representation = [CLS] hidden state,
loss = ``bigbatch.clip_loss`` with a learned scale. Per batch size B: one training step's
forward + backward (no optimizer), median of CUDA-event times after a warm-up, and peak memory
above the live memory before the step (weights and pre-allocated ``.grad``). Out-of-memory is
recorded as a result. A correctness check (bigbatch.GradCache vs the full-batch gradient with the
same dropout masks) runs first.

    python -m bigbatch.bench.gradcache                    # the H200 run (JSON + PNG)
    python -m bigbatch.bench.gradcache --tiny --cpu       # a dry run of the code paths (~1 min on 2 cores; JSON in /tmp)
    python -m bigbatch.bench.gradcache --compile --skip public offload   # both encoders torch.compile'd, every method
"""

from __future__ import annotations

import argparse
import gc as _gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from .common import hardware, matmul_tflops, measure, output_path, wall_time_ms, write_json


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_public_gradcache():
    """luyug's GradCache class from the PyPI package ``gradcache`` 0.0.1, unmodified.

    That release ships its package as ``gradcache`` while its modules import ``grad_cache.*``
    (the GitHub layout), so ``from gradcache import GradCache`` silently yields nothing; aliasing
    the package under its GitHub name makes the unmodified module importable. Returns
    (class or None, a note saying what was loaded or why not)."""
    try:
        import gradcache
    except ImportError as exc:
        return None, f"package gradcache not installed ({exc})"
    sys.modules.setdefault("grad_cache", gradcache)
    try:
        from gradcache.grad_cache import GradCache as Public
    except ImportError as exc:
        return None, f"gradcache {getattr(gradcache, '__version__', '0.0.1')} failed to import: {exc}"
    return Public, "PyPI gradcache 0.0.1 (luyug/GradCache, grad_cache/grad_cache.py), imported with module alias grad_cache->gradcache"


def _bert(tiny: bool, device: torch.device):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128) if tiny else BertConfig()
    return BertModel(cfg).to(device).train(), cfg


class DualEncoder:
    """The benchmark's setting: query and passage BERT encoders (seed 0), a learned logit scale,
    every parameter's ``.grad`` pre-allocated (each method starts from the same live memory), and
    ``loss_fn`` = ``bigbatch.clip_loss`` on fp32 copies of the representations."""

    def __init__(self, device: torch.device, tiny: bool = False) -> None:
        import bigbatch

        torch.manual_seed(0)
        self.mq, self.cfg = _bert(tiny, device)
        self.mp, _ = _bert(tiny, device)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0, device=device))
        self.params = list(self.mq.parameters()) + list(self.mp.parameters()) + [self.logit_scale]
        for t in self.params:
            t.grad = torch.zeros_like(t)
        self._clip = bigbatch.clip_loss

    def loss_fn(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self._clip(q.float(), k.float(), self.logit_scale.exp(), backend="torch")


def _library_settings(models: List[torch.nn.Module]) -> Dict[str, Any]:
    """What the library does with these models in the bigbatch rows: the LayerNorms its re-runs
    give the one-pass backward (none on the CPU, in a compiled model, or where the kernel cannot run)."""
    from bigbatch.gradcache import norms

    return {"one_pass_layer_norms": sum(len(norms.model_norms(m)) for m in models)}


def _inputs(b: int, seq: int, vocab: int, device: torch.device, seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (b, seq), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones(b, seq, dtype=torch.long, device=device)}


def _rep(out: Any) -> torch.Tensor:
    return out.last_hidden_state[:, 0]


def _cost_mib(cost) -> dict:
    """A probed ``ChunkCost`` for the JSON: bytes in MiB, rows as they are; the points measured at
    planned chunk sizes as ``[rows, peak MiB, held MiB]``."""
    out = {k: round(v / 2**20, 3) for k, v in vars(cost).items() if isinstance(v, float)}
    out["probe_rows"] = cost.probe_rows
    out["measured"] = [[r, round(p / 2**20, 1), round(h / 2**20, 1)] for r, p, h in cost.measured]
    return out


def _time(fn: Callable[[], Any], cuda: bool, warmup: int, repeat: int) -> Dict[str, Any]:
    if cuda:
        base = torch.cuda.memory_allocated()
        r = measure(fn, warmup=warmup, repeat=repeat)
        r["base_gib"] = base / 2**30
        if r["status"] == "ok":
            r["peak_total_gib"] = r["extra_gib"] + r["base_gib"]
        return r
    times = wall_time_ms(fn, warmup=warmup, repeat=repeat)
    return {"status": "ok", "median_ms": statistics.median(times), "times_ms": times, "extra_gib": None}


def _encode_step(bigbatch, mq, mp, qi, pi, loss_fn, amp) -> None:
    """A user's own step with cached_encode: encoders and loss under autocast, plain backward."""
    with torch.autocast(**amp):
        loss = loss_fn(bigbatch.cached_encode(mq, qi, 16, get_rep_fn=_rep), bigbatch.cached_encode(mp, pi, 16, get_rep_fn=_rep))
    loss.backward()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default 512 1024 2048 8192 (--tiny: 16 32)")
    p.add_argument("--budget", default="16GiB", help="memory_budget of bigbatch.GradCache")
    p.add_argument("--public-chunk", type=int, default=128, help="chunk size of the public GradCache")
    p.add_argument("--q-len", type=int, default=32)
    p.add_argument("--p-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="tiny BERT (CPU dry run)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile(dynamic=True) both encoders; every method (full step, public, bigbatch) runs the compiled "
                        "modules (default JSON: benchmarks/results/gradcache_compiled_h200.json)")
    p.add_argument("--skip", nargs="*", default=[], choices=["full", "public", "bigbatch", "offload"])
    p.add_argument("--public-batches", type=int, nargs="*", default=None,
                   help="batch sizes at which the public GradCache runs (default: all)")
    p.add_argument("--offload-batches", type=int, nargs="*", default=None,
                   help="batch sizes at which bigbatch.GradCache also runs with inputs and reps offloaded to the CPU")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gradcache_h200.json; "
                   "with --tiny or --cpu a file in the temporary directory, never the committed results)")
    args = p.parse_args(argv)
    if min(args.batches or [1]) < 1 or args.repeat < 1 or args.public_chunk < 1 or min(args.q_len, args.p_len) < 1:
        p.error("--batches, --repeat, --public-chunk, --q-len and --p-len must be positive")
    from bigbatch.gradcache import parse_memory

    try:
        parse_memory(args.budget, "--budget")
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    dry = args.tiny or args.cpu
    if not dry and not torch.cuda.is_available():
        # a CPU run would otherwise write the H200 results file with CPU numbers
        print("this benchmark needs a CUDA GPU (or --cpu / --tiny for a dry run)", file=sys.stderr)
        return 2
    stem = "gradcache_compiled" if args.compile else "gradcache"
    args.out = output_path(p, args, f"benchmarks/results/{stem}_h200.json",
                           f"{stem}_dry_run.json" if dry else f"{stem}_h200.json",
                           ["batches", "budget", "public_chunk", "q_len", "p_len", "skip", "public_batches",
                            "offload_batches"], canonical=not dry)
    if args.batches is None:
        args.batches = [16, 32] if args.tiny else [512, 1024, 2048, 8192]
    if args.offload_batches is None:
        args.offload_batches = [args.batches[-1]] if args.tiny else [8192]
    if importlib.util.find_spec("transformers") is None:
        print("this benchmark's encoders are Hugging Face BertModels: pip install 'bigbatch[bench]'", file=sys.stderr)
        return 2

    import bigbatch
    from bigbatch.gradcache import GradCache

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    setup = DualEncoder(device, args.tiny)
    mq, mp, cfg, params, loss_fn = setup.mq, setup.mp, setup.cfg, setup.params, setup.loss_fn
    if args.compile:
        # one dynamic graph per grad mode instead of a recompile per chunk / batch shape; the
        # compiled modules share the eager ones' parameters, so `params` and the .grad stay theirs
        mq, mp = torch.compile(mq, dynamic=True), torch.compile(mp, dynamic=True)

    amp = dict(device_type=device.type, dtype=torch.bfloat16)
    result: Dict[str, Any] = {
        "benchmark": "gradcache", "hardware": hardware(), "args": vars(args),
        "model": ("2 x BertModel(BertConfig()) random weights, train mode" if not args.tiny else "tiny BERT")
                 + (", torch.compile(dynamic=True)" if args.compile else ""),
        "loss": "bigbatch.clip_loss(backend='torch'), learned scale", "rows": [],
        "library": _library_settings([mq, mp]),
    }
    if cuda:
        _log("matmul rate")
        result["bf16_matmul_tflops"] = matmul_tflops()
    public_cls, note = load_public_gradcache()
    result["public_gradcache"] = note
    _log(f"public GradCache: {note}")

    # -- correctness on this device: same dropout masks, bf16 autocast ------------------------
    b0 = 64 if not args.tiny else 24  # (tiny: chunks of 8 + 16, a re-run checked too)
    qi, pi = _inputs(b0, args.q_len, cfg.vocab_size, device, 1), _inputs(b0, args.p_len, cfg.vocab_size, device, 2)
    def grads():
        return torch.cat([t.grad.float().flatten() for t in params])
    for t in params:
        t.grad.zero_()
    torch.manual_seed(5)
    # reference: the same chunks, one graph over the whole batch, one autocast region per chunk
    # (in one region for all, the chunks share each weight's bf16 cast and their weight gradients
    # are summed in bf16 before the cast's backward: the tiny CPU check 1.1e-4 off instead of bitwise)
    def ref_chunks(m, x):
        out = []
        for c in bigbatch.gradcache.chunking.split_batch(x, 16):
            with torch.autocast(**amp):
                out.append(_rep(m(**c)))
        return torch.cat(out)

    q, k = ref_chunks(mq, qi), ref_chunks(mp, pi)
    with torch.autocast(**amp):
        ref_loss = loss_fn(q, k)
    ref_loss.backward()
    g_ref = grads()
    for t in params:
        t.grad.zero_()
    torch.manual_seed(5)
    gcache = GradCache([mq, mp], chunk_sizes=16, loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
    loss = gcache(qi, pi)
    g = grads()
    result["check"] = {
        "batch": b0, "chunk": 16, "loss_ref": ref_loss.item(), "loss": loss.item(),
        "grad_rel_err": ((g - g_ref).norm() / g_ref.norm()).item(),
    }
    # the same step with PyTorch's LayerNorm backward in the re-runs (the one-pass kernel off): the
    # reference's own ops, so the caching alone is measured (the kernel's fp32 sums in another
    # order flip bf16 roundings downstream: a difference of bf16's size, ~4e-3, not an error)
    from bigbatch.gradcache import norms

    for t in params:
        t.grad.zero_()
    torch.manual_seed(5)
    saved, norms.ENABLED = norms.ENABLED, False
    try:
        GradCache([mq, mp], chunk_sizes=16, loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)(qi, pi)
    finally:
        norms.ENABLED = saved
    result["check"]["grad_rel_err_pytorch_norms"] = ((grads() - g_ref).norm() / g_ref.norm()).item()
    # the same step with inputs offloaded (pinned CPU, side-stream copies) and reps on the CPU,
    # and through the autograd-native cached_encode: all must give the same gradients
    cpu_q = {kk: v.cpu() for kk, v in qi.items()}
    cpu_p = {kk: v.cpu() for kk, v in pi.items()}
    variants = {
        "offload": lambda: GradCache([mq, mp], chunk_sizes=16, loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16,
                                     offload_inputs=True, offload_reps=True)(cpu_q, cpu_p),
        "cached_encode": lambda: _encode_step(bigbatch, mq, mp, qi, pi, loss_fn, amp),
    }
    for name, fn in variants.items():
        for t in params:
            t.grad.zero_()
        torch.manual_seed(5)
        fn()
        result["check"][f"{name}_grad_rel_err_vs_gradcache"] = ((grads() - g).norm() / g.norm()).item()
    _log(f"check: {result['check']}")
    del q, k, ref_loss, g, g_ref, gcache
    for t in params:
        t.grad.zero_()

    bb = GradCache([mq, mp], memory_budget=args.budget, loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
    bb_off = GradCache([mq, mp], memory_budget=args.budget, loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16,
                       offload_inputs=True, offload_reps=True)
    public = None
    if public_cls is not None:
        public = public_cls([mq, mp], args.public_chunk, loss_fn=loss_fn, get_rep_fn=_rep)

    for b in args.batches:
        qi, pi = _inputs(b, args.q_len, cfg.vocab_size, device, 10 + b), _inputs(b, args.p_len, cfg.vocab_size, device, 20 + b)
        rep = args.repeat if b < 4096 else max(1, args.repeat - 1)
        row: Dict[str, Any] = {"batch": b}

        def full():
            with torch.autocast(**amp):
                l = loss_fn(_rep(mq(**qi)), _rep(mp(**pi)))
            l.backward()

        def pub():
            with torch.autocast(**amp):
                public(qi, pi)

        def ours():
            bb(qi, pi)

        qc, pc = ({kk: v.cpu().pin_memory() if cuda else v for kk, v in d.items()} for d in (qi, pi))

        def ours_offload():
            bb_off(qc, pc)

        for name, fn in (("full", full), ("public", pub), ("bigbatch", ours), ("bigbatch_offload", ours_offload)):
            if name == "bigbatch_offload" and (b not in args.offload_batches or "offload" in args.skip):
                continue
            if name == "public" and args.public_batches is not None and b not in args.public_batches:
                row[name] = {"status": "skipped"}
                continue
            if name in args.skip or (name == "public" and public is None):
                row[name] = {"status": "skipped"}
                continue
            _log(f"B={b} {name} ...")
            row[name] = _time(fn, cuda, warmup=1, repeat=rep)
            _gc.collect()
            _log(f"B={b} {name}: {row[name].get('median_ms', '-')} ms, extra {row[name].get('extra_gib')} GiB, {row[name]['status']}")
        if row["full"].get("status") == "ok" and row["bigbatch"].get("status") == "ok":
            # the floor for gradient caching: the full step plus a no-grad forward of every re-run row
            fwd = {}
            for side, (m, inp) in (("q", (mq, qi)), ("p", (mp, pi))):
                def nograd(m=m, inp=inp):
                    with torch.no_grad(), torch.autocast(**amp):
                        m(**inp)
                fwd[side] = _time(nograd, cuda, warmup=1, repeat=rep)["median_ms"]
            rerun = [1 - k / b for k in bb.last_kept_rows]
            row["nograd_forward_ms"] = fwd
            row["ideal_ms"] = row["full"]["median_ms"] + fwd["q"] * rerun[0] + fwd["p"] * rerun[1]
            row["ideal_over_full"] = row["ideal_ms"] / row["full"]["median_ms"]
        row["bigbatch"]["chunk_sizes"] = list(bb.last_chunk_sizes)
        row["bigbatch"]["chunk_rows"] = [list(r) for r in bb.last_chunk_rows]
        row["bigbatch"]["kept_rows"] = list(bb.last_kept_rows)
        row["bigbatch"]["kept_chunks"] = bb.last_kept
        # the probe's memory model per input (MiB): why the chunks and the kept graph are what they are
        row["bigbatch"]["chunk_cost_mib"] = [_cost_mib(c) for c, _ in bb._prober._cache.values()]
        if row["full"].get("status") == "ok" and row["bigbatch"].get("status") == "ok":
            row["bigbatch_over_full"] = row["bigbatch"]["median_ms"] / row["full"]["median_ms"]
        if row["public"].get("status") == "ok" and row["full"].get("status") == "ok":
            row["public_over_full"] = row["public"]["median_ms"] / row["full"]["median_ms"]
        result["rows"].append(row)
        write_json(args.out, result)

    # the budget caps the device's whole allocation (weights and .grad included): compare totals
    ok = [r["bigbatch"]["peak_total_gib"] for r in result["rows"] if r["bigbatch"].get("peak_total_gib") is not None]
    if ok:
        budget = bigbatch.gradcache.parse_memory(args.budget) / 2**30
        result["targets"] = {
            "peak_le_budget": max(ok) <= budget,
            "peak_spread": max(ok) / min(ok) - 1,
            "ratios_vs_full": [r.get("bigbatch_over_full") for r in result["rows"]],
        }
    if args.compile:
        from torch._dynamo.utils import counters  # how many graphs dynamo built (recompiles show here)

        result["compile_stats"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")}
    write_json(args.out, result)
    _plot(result, Path(args.out).with_suffix(".png"))
    print(f"{'B':>6} {'full ms':>9} {'public ms':>10} {'bigbatch ms':>12} {'bb/full':>8} {'ideal':>6} {'full GiB':>9} {'pub GiB':>8} {'bb GiB':>7} chunks")
    for r in result["rows"]:
        def f(k, key):
            v = r[k].get(key)
            return "oom" if r[k].get("status") == "oom" else ("-" if v is None else f"{v:.1f}" if key == "median_ms" else f"{v:.2f}")
        print(f"{r['batch']:>6} {f('full','median_ms'):>9} {f('public','median_ms'):>10} {f('bigbatch','median_ms'):>12} "
              f"{r.get('bigbatch_over_full', float('nan')):>8.2f} {r.get('ideal_over_full', float('nan')):>6.2f} {f('full','peak_total_gib'):>9} {f('public','peak_total_gib'):>8} "
              f"{f('bigbatch','peak_total_gib'):>7} {r['bigbatch'].get('chunk_sizes')}")
    print(f"wrote {args.out}")
    return 0


def _plot(result: Dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("full", "public", "bigbatch"):
        pts = [(r["batch"], r[name]) for r in result["rows"] if r[name].get("status") == "ok"]
        if not pts:
            continue
        bs = [b for b, _ in pts]
        axes[0].plot(bs, [m["median_ms"] / 1e3 for _, m in pts], "o-", label=name)
        if pts[0][1].get("peak_total_gib") is not None:
            axes[1].plot(bs, [m["peak_total_gib"] for _, m in pts], "o-", label=name)
    for ax, yl in zip(axes, ("step time (s)", "peak memory allocated (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(yl)
        ax.legend()
    fig.suptitle(f"BERT-base dual encoder, bf16: {result['hardware'].get('gpu', 'cpu')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
