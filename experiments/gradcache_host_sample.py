"""Where does the host's time go in a cached step on the GPU machine? (run under py-spy)

The setting of ``bigbatch.bench.gradcache`` (BERT-base dual encoder, bf16 autocast, 16 GiB budget).
``run``: loops the full-batch step or ``bigbatch.GradCache``'s step at one batch size for
``--seconds`` (after warm-up), to be sampled by ``py-spy record -f raw``. ``attribute``: reads such
a raw file and splits the samples taken inside steps into the model's forward, the backward calls,
the loss, and the library's own code (by its innermost bigbatch function).

    py-spy record -r 500 -f raw -o /tmp/cached.txt -- python experiments/gradcache_host_sample.py run --batch 512
    python experiments/gradcache_host_sample.py attribute /tmp/cached.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# stack markers: the model's forward, the backward calls, the loss
PARTS = (("forward", ("call_model ", "_call_impl ")), ("backward", ("chunk_backward ", "backward (torch/"),),
         ("loss", ("loss_fn ", "clip_loss ")))


def run(args: argparse.Namespace) -> None:
    from bigbatch.bench.gradcache import DualEncoder, _rep
    from bigbatch.gradcache import GradCache
    from gradcache_fused_ab import full_step  # (an experiment next to this one)

    dev = torch.device("cuda")
    setup = DualEncoder(dev)
    mq, mp, loss_fn = setup.mq, setup.mp, setup.loss_fn
    qi, pi, full = full_step(setup, args.batch, dev)
    if args.full:
        def step():
            full()
    else:
        gc = GradCache([mq, mp], memory_budget="16GiB", loss_fn=loss_fn, get_rep_fn=_rep, autocast_dtype=torch.bfloat16)

        def step():
            gc(qi, pi)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        step()
        n += 1
    torch.cuda.synchronize()
    print(f"{'full' if args.full else 'cached'} B={args.batch}: {n} steps, {(time.perf_counter() - start) / n * 1e3:.1f} ms/step")


def attribute(path: str, top: int) -> None:
    total, parts, lib = 0, collections.Counter(), collections.Counter()
    for line in open(path):
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        is_step = [f.split(" (")[0].split(".")[-1] == "step" for f in frames]  # run.<locals>.step
        if not any(is_step):
            continue
        n = int(n)
        total += n
        inner = frames[is_step.index(True) + 1:]
        part = next((name for name, marks in PARTS if any(f.startswith(marks) or any(m in f for m in marks) for f in inner)), None)
        if part is None:
            ours = [f.split(" (")[0] for f in inner if "bigbatch" in f]
            part = "library" if ours else "other"
            if ours:
                lib[" <- ".join(ours[-1:-3:-1])] += n
        parts[part] += n
    print(f"{total} samples in steps")
    for name, n in parts.most_common():
        print(f"  {name:9s} {100 * n / total:5.1f}%")
    for k, n in lib.most_common(top):
        print(f"    {100 * n / total:5.1f}%  {k}")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--batch", type=int, default=512)
    r.add_argument("--seconds", type=float, default=20.0)
    r.add_argument("--full", action="store_true")
    a = sub.add_parser("attribute")
    a.add_argument("path")
    a.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        attribute(args.path, args.top)


if __name__ == "__main__":
    main()
