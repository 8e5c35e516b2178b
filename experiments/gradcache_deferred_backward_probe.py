"""Bound: how much of a cached step's GPU idle comes from Hugging Face's per-forward host sync
blocking the next chunk's launches behind the previous chunk's backward? (one GPU)

In pass 2, chunk i's backward is issued right after its forward; the next chunk's forward then
syncs the host on its attention-mask check (``padding_mask.all()``) and so waits until that
backward has run on the GPU, after which the host-bound forward starves the GPU. This probe
defers chunk i's backward into chunk i+1's forward, issuing it from a forward pre-hook on the
BERT encoder stack, i.e. right *after* the mask sync: the host then launches chunk i+1's layers
while the GPU runs chunk i's backward. Model-specific (the hook point is BERT's ``encoder``), so
it is a measurement, not a library feature. Checks that the gradients equal the default step's
and records the peak memory (the next chunk's embeddings live during the backward).

    cd experiments && python gradcache_deferred_backward_probe.py --out /tmp/deferred.json
"""

from __future__ import annotations


import torch

import bigbatch.gradcache.cache as cache_mod
from bigbatch.bench.gradcache import _rep
from bigbatch.gradcache import GradCache, engine
from bigbatch.gradcache.accumulate import accumulating
from bigbatch.gradcache.buffers import buffers_restored
from bigbatch.gradcache.chunking import model_device, staged

from gradcache_fused_ab import ab_setup, full_step, interleaved, record


def backprop_deferred(units, grads, opts):
    """engine.backprop with each re-run chunk's backward issued inside the next chunk's forward."""
    slices = engine.grad_slices(units, grads, opts)
    with accumulating() as accs:
        engine.backprop_kept(units, slices, opts, None, accs)
        for rerun in engine.rerun_groups(units, slices):
            model = units[rerun[0]].model
            device = model_device(model)
            pending = []
            acc = accs.of(model)

            def flush(*_):
                while pending:
                    rep, g = pending.pop()
                    with torch.autocast(device.type, enabled=False), acc.chunk():
                        torch.autograd.backward(rep, g)

            handle = model.encoder.register_forward_pre_hook(flush)
            try:
                with torch.autocast(device.type, dtype=opts.autocast_dtype), buffers_restored([model]):
                    for k, chunk in zip(rerun, staged([units[k].chunk for k in rerun], device, False)):
                        u = units[k]
                        with torch.enable_grad(), u.rng.replay():
                            rep = engine._rep(opts, model, chunk, u.rows)
                        pending.append((rep, slices[k].to(rep.device, rep.dtype)))
                        del rep
                    flush()
            finally:
                handle.remove()


def main() -> None:
    args, device, setup, out = ab_setup("gradcache_deferred_backward_probe", [1024, 2048], 3, 3)
    mq, mp, loss_fn, params = setup.mq, setup.mp, setup.loss_fn, setup.params
    gc = GradCache([mq, mp], memory_budget="16GiB", loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)
    default_backprop = cache_mod.backprop

    def use(deferred: bool):
        cache_mod.backprop = backprop_deferred if deferred else default_backprop

    for b in args.batches:
        qi, pi, full = full_step(setup, b, device)

        def cached(deferred: bool):
            def step():
                use(deferred)
                try:
                    gc(qi, pi)
                finally:
                    use(False)
            return step

        row = {"batch": b}
        # exactness: the same step, default vs deferred, from the same seed
        got = {}
        for name, deferred in (("default", False), ("deferred", True)):
            for t in params:
                t.grad.zero_()
            torch.manual_seed(123)
            cached(deferred)()
            got[name] = torch.cat([t.grad.float().flatten() for t in params])
        row["grad_rel_diff_deferred_vs_default"] = ((got["deferred"] - got["default"]).norm() / got["default"].norm()).item()
        # peak memory above the step's start
        for name, deferred in (("default", False), ("deferred", True)):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            cached(deferred)()
            torch.cuda.synchronize()
            row[f"{name}_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        variants = {"full": full, "default": cached(False), "deferred": cached(True)}
        row.update(interleaved(variants, args.rounds, args.repeat, f"B={b}"))
        for name in ("default", "deferred"):
            row[f"{name}_over_full"] = row[name]["median_ms"] / row["full"]["median_ms"]
        row["chunk_rows"] = [list(x) for x in gc.last_chunk_rows]
        record(out, row, variants, args.out)


if __name__ == "__main__":
    main()
