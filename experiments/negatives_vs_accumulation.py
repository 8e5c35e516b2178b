"""More negatives at the same memory: exact cached batch vs gradient accumulation vs a small batch.

The claim of the GradCache and Inf-CL papers, on bigbatch's built-in code-search task
(docstring -> code, held-out modules): with the encoder memory of one 256-row chunk,

* ``cached``     batch 4096 through GradCache in chunks of 256: the exact 4096-batch gradient,
                 4095 negatives per query;
* ``accumulate`` 16 x 256 gradient accumulation: the same 4096 examples per update, but each
                 loss only sees the 255 negatives of its micro-batch;
* ``plain``      batch 256: 255 negatives, 16x more (smaller) updates;

each trained for the same number of epochs with the same optimiser settings, over several
seeds (the seed sets the module split, the initialisation and the data order; the arms of one
seed share them). Held-out Recall@1 / Recall@10 / MRR after training: mean and sample std.

Run: ``python experiments/negatives_vs_accumulation.py`` (about 10-20 min on 2 CPU cores with
the defaults); writes ``experiments/results/negatives_vs_accumulation.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from bigbatch.train.loop import TrainConfig, train

ARMS = {
    "cached": dict(batch_size=4096, chunk_size=256, accumulate=False),
    "accumulate": dict(batch_size=4096, chunk_size=256, accumulate=True),
    "plain": dict(batch_size=256, chunk_size=256, accumulate=False),
}
LABELS = {
    "cached": "cached batch 4096 (GradCache, chunks of 256)",
    "accumulate": "gradient accumulation 16 x 256",
    "plain": "plain batch 256",
}
KEYS = ("recall@1", "recall@10", "mrr")


def run_arm(arm: str, seed: int, args, workdir: Path) -> Dict:
    cfg = TrainConfig(
        **ARMS[arm], seed=seed, epochs=args.epochs, lr=args.lr, dim=args.dim, buckets=args.buckets,
        max_pairs=args.max_pairs, out=str(workdir / f"{arm}-{seed}"), progress=False, save=False,
        eval_every=None,
    )
    t0 = time.perf_counter()
    res = train(cfg, log=lambda s: None)
    curve = [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["epoch"], r["eval"]["recall@1"]) for r in curve if "eval" in r]
    return {"arm": arm, "seed": seed, "after": res["after"], "before": res["before"], "steps": res["steps"],
            "seconds": time.perf_counter() - t0, "curve": curve}


def summarise(runs: List[Dict]) -> Dict[str, Dict[str, List[float]]]:
    out: Dict[str, Dict[str, List[float]]] = {}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        out[arm] = {}
        for k in KEYS:
            vals = [r["after"][k] for r in rs]
            out[arm][k] = [statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0]
    return out


def table(summary, runs, args) -> str:
    untrained = statistics.mean(r["before"]["recall@1"] for r in runs)
    lines = [
        f"Held-out docstring -> code retrieval after {args.epochs:g} epochs, mean +- std over seeds "
        f"{', '.join(map(str, args.seeds))} (untrained Recall@1: {100 * untrained:.1f}%).",
        "",
        "| training (memory of one 256-row chunk) | negatives / query | updates | Recall@1 | Recall@10 | MRR |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        s = summary[arm]
        steps = round(statistics.mean(r["steps"] for r in runs if r["arm"] == arm))
        neg = 4095 if arm == "cached" else 255
        lines.append(
            f"| {LABELS[arm]} | {neg} | {steps} | {100 * s['recall@1'][0]:.1f} +- {100 * s['recall@1'][1]:.1f}% | "
            f"{100 * s['recall@10'][0]:.1f} +- {100 * s['recall@10'][1]:.1f}% | {s['mrr'][0]:.3f} +- {s['mrr'][1]:.3f} |"
        )
    by = {(r["arm"], r["seed"]): r["after"]["recall@1"] for r in runs}
    for other in ("accumulate", "plain"):
        diffs = [100 * (by[("cached", sd)] - by[(other, sd)]) for sd in args.seeds
                 if ("cached", sd) in by and (other, sd) in by]
        if diffs:
            spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
            lines.append(f"\nPaired by seed, cached minus {other}: Recall@1 {statistics.mean(diffs):+.2f} +- "
                         f"{spread:.2f} points (per seed: {', '.join(f'{x:+.1f}' for x in diffs)}).")
    lines.append(f"\nConfig: {args.epochs:g} epochs, peak lr {args.lr_used:g} (AdamW/SparseAdam, 5% warm-up, cosine), "
                 f"bag encoder dim {args.dim}, {args.buckets} buckets, up to {args.max_pairs} built-in pairs.")
    return "\n".join(lines)


def plot(summary, runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_c) = plt.subplots(1, 2, figsize=(11, 4))
    arms = list(ARMS)
    means = [100 * summary[a]["recall@1"][0] for a in arms]
    stds = [100 * summary[a]["recall@1"][1] for a in arms]
    ax_b.bar(range(len(arms)), means, yerr=stds, capsize=6, color=["tab:green", "tab:orange", "tab:gray"])
    ax_b.set_xticks(range(len(arms)), ["cached 4096", "accum. 16x256", "plain 256"])
    ax_b.set_ylabel("held-out Recall@1 (%)")
    ax_b.set_title("after the same epochs, same memory per step")
    for arm, color in zip(arms, ["tab:green", "tab:orange", "tab:gray"]):
        for r in (r for r in runs if r["arm"] == arm):
            xs, ys = zip(*r["curve"])
            ax_c.plot(xs, [100 * y for y in ys], color=color, alpha=0.7,
                      label=LABELS[arm] if r["seed"] == runs[0]["seed"] else None)
    ax_c.set_xlabel("epoch")
    ax_c.set_ylabel("held-out Recall@1 (%)")
    ax_c.set_title("per seed")
    ax_c.grid(alpha=0.3)
    ax_c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=None, help="default: the trainer's default for the model")
    p.add_argument("--dim", type=int, default=TrainConfig.dim)
    p.add_argument("--buckets", type=int, default=TrainConfig.buckets)
    p.add_argument("--max-pairs", type=int, default=TrainConfig.max_pairs)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--name", default="negatives_vs_accumulation", help="stem of the result files")
    p.add_argument("--render", metavar="JSON", help="only redraw the table and plot from a results JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        for k, v in saved["config"].items():
            if k not in ("render", "out", "name"):
                setattr(args, k, v)
        return finish(saved["runs"], args, out)
    args.lr_used = TrainConfig(lr=args.lr).peak_lr()
    runs: List[Dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in ARMS:
                r = run_arm(arm, seed, args, Path(tmp))
                runs.append(r)
                print(f"[{time.perf_counter() - t0:6.0f} s] seed {seed} {arm:<10} Recall@1 {100 * r['after']['recall@1']:.1f}% "
                      f"(untrained {100 * r['before']['recall@1']:.1f}%), {r['steps']} updates, {r['seconds']:.0f} s",
                      flush=True)
                summary = summarise(runs) if all(any(x["arm"] == a for x in runs) for a in ARMS) else None
                (out / f"{args.name}.json").write_text(json.dumps(
                    {"config": vars(args), "runs": runs, "summary": summary, "seconds": time.perf_counter() - t0,
                     "hardware": _hardware()}, indent=2) + "\n")
    return finish(runs, args, out)


def finish(runs: List[Dict], args, out: Path) -> int:
    if getattr(args, "lr_used", None) is None:
        args.lr_used = args.lr if args.lr is not None else TrainConfig().peak_lr()
    summary = summarise(runs)
    md = table(summary, runs, args)
    (out / f"{args.name}.md").write_text(md + "\n")
    plot(summary, runs, out / f"{args.name}.png")
    print(md)
    return 0


def _hardware() -> Dict:
    from bigbatch.bench.common import hardware

    return hardware()


if __name__ == "__main__":
    sys.exit(main())
