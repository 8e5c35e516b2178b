"""Would pass 1 (the no-grad forwards) of gradient caching gain from running its chunks on two
CUDA streams? (one GPU)

Hugging Face models read the attention mask back to the host at the start of every forward (a
stream sync), so on one stream each chunk's forward starts from an empty queue and the GPU waits
for the host's first launches. A sync waits only for its own stream: with chunks alternating
between two side streams, one stream's sync leaves the other's queued kernels running, and two
chunks' memory-bound kernels may overlap. Random state is unaffected (dropout's Philox offsets are
taken on the host at launch, in launch order), so the representations must be bitwise the ones of
the one-stream pass: checked here.

The setting of ``bigbatch.bench.gradcache`` at B = 2048 with GradCache's 16 GiB plan: queries in
chunks of 1003 + 1045 rows, passages in 7 no-grad chunks of 253/254 rows (the 8th, 275 rows, is
the kept graph, not part of this comparison). Each model's first chunk runs on the main stream
(it makes autocast's cached bf16 weights, which the side streams then wait for).

    python experiments/gradcache_stream_probe.py --out /tmp/gradcache_stream_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bigbatch.bench.common import hardware
from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep
from bigbatch.gradcache.chunking import split_rows
from gradcache_idle_probe import timed as idle_timed  # (experiments/ is the script's directory)

AMP = dict(device_type="cuda", dtype=torch.bfloat16)


def pass1(models_chunks, n_streams: int):
    """No-grad forwards of every chunk, model by model (one autocast context each, as the engine
    does); ``n_streams`` = 0: all on the current stream; else chunks after each model's first
    alternate between ``n_streams`` side streams. Returns the representations (main-stream safe)."""
    main = torch.cuda.current_stream()
    sides = [torch.cuda.Stream() for _ in range(n_streams)]
    reps = []
    k = 0
    with torch.no_grad():
        for model, chunks in models_chunks:
            with torch.autocast(**AMP):
                ready = None
                for j, x in enumerate(chunks):
                    if j == 0 or not sides:
                        reps.append(_rep(model(**x)).clone())
                        ready = torch.cuda.Event()
                        ready.record(main)
                        continue
                    s = sides[k % len(sides)]
                    k += 1
                    s.wait_event(ready)  # the cached bf16 weights (and inputs) exist
                    with torch.cuda.stream(s):
                        r = _rep(model(**x)).clone()
                    r.record_stream(main)
                    reps.append(r)
                for s in sides:  # leaving autocast frees the cached weights: side work must be done
                    main.wait_stream(s)
    return reps


def timed(fn, repeat=7):
    """gradcache_idle_probe's CUDA-event median, plus the peak memory the calls add."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = idle_timed(fn, repeat=repeat)
    out["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    mq, mp, cfg = setup.mq, setup.mp, setup.cfg
    b = 2048
    qi, pi = _inputs(b, 32, cfg.vocab_size, dev, 1), _inputs(b, 128, cfg.vocab_size, dev, 2)
    q_rows, p_rows = [1003, 1045], [253] * 5 + [254] * 2
    qc = split_rows(qi, q_rows)
    pc = split_rows({k: v[: sum(p_rows)] for k, v in pi.items()}, p_rows)
    pcn = [{"input_ids": x["input_ids"]} for x in pc]
    qcn = [{"input_ids": x["input_ids"]} for x in qc]
    res = {"experiment": "gradcache_stream_probe", "hardware": hardware(), "batch": b,
           "q_rows": q_rows, "p_rows": p_rows, "variants": {}, "equal": {}}

    cases = {"mask": [(mq, qc), (mp, pc)], "nomask": [(mq, qcn), (mp, pcn)]}
    # exactness: the same seed gives bitwise the same representations on 1, 2, 3 streams
    for name, mc in cases.items():
        outs = {}
        for n in (0, 2, 3):
            torch.manual_seed(123)
            outs[n] = torch.cat(pass1(mc, n))
            torch.cuda.synchronize()
        res["equal"][name] = {str(n): bool(torch.equal(outs[0], outs[n])) for n in (2, 3)}
        print("equal", name, res["equal"][name], flush=True)
    for r in range(args.rounds):  # interleaved rounds: drift hits every variant alike
        for name, mc in cases.items():
            for n in (0, 2, 3):
                key = f"{name}_streams{n}"
                t = timed(lambda: pass1(mc, n))
                res["variants"].setdefault(key, []).append(t)
                print(r, key, round(t["ms"], 2), "issue", round(t["issue_ms"], 2),
                      "peak", round(t["peak_extra_gib"], 3), flush=True)
    res["summary_ms"] = {k: statistics.median(x["ms"] for x in v) for k, v in res["variants"].items()}
    print(json.dumps(res["summary_ms"], indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
