"""CPU memory benchmark: peak RSS growth of one forward+backward of the CLIP loss,
full-matrix reference vs the torch tile backend, over the batch size.

Each case runs in a fresh subprocess so that ``ru_maxrss`` (the process's peak resident
set) measures that case alone: growth = peak after forward+backward - peak after the
inputs were created. A reference case whose B x B logits (and their copies in the
backward) would not fit in RAM is recorded as skipped with the estimate, not run.

    python -m bigbatch.bench.memory                 # default grid, JSON + PNG to benchmarks/results/
    python -m bigbatch.bench.memory --batches 4096 32768 --dims 64
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .common import hardware, output_path, positive_int, write_json

# Live fp32 B x B matrices during the reference's forward+backward (logits, softmax of
# each direction, their gradients): an estimate used only to skip cases that cannot fit.
_REFERENCE_BXB_COPIES = 5


def _rss_mib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(impl: str, b: int, d: int, seed: int) -> Dict[str, Any]:
    import torch

    import bigbatch

    torch.manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, d), dim=1).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(b, d), dim=1).requires_grad_()
    scale = torch.tensor(14.3, requires_grad=True)
    before = _rss_mib()
    t0 = time.perf_counter()
    loss = bigbatch.clip_loss(q, k, scale, backend=impl)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {
        "loss": loss.item(),
        "seconds": seconds,
        "rss_before_mib": before,
        "rss_peak_mib": _rss_mib(),
        "growth_mib": _rss_mib() - before,
        "input_mib": 2 * b * d * 4 / 2**20,
    }


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def run_case(impl: str, b: int, d: int, seed: int = 0) -> Dict[str, Any]:
    case: Dict[str, Any] = {"impl": impl, "batch": b, "dim": d}
    if impl == "reference":
        need = _REFERENCE_BXB_COPIES * b * b * 4
        if need > 0.8 * _available_bytes():
            case.update(status="skipped", reason=f"needs ~{need / 2**30:.1f} GiB for B x B matrices (out of memory)")
            return case
    cmd = [sys.executable, "-m", "bigbatch.bench.memory", "--child", impl, str(b), str(d), str(seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        case.update(status="failed", returncode=proc.returncode, stderr=proc.stderr[-2000:])
        return case
    case.update(status="ok", **json.loads(proc.stdout.strip().splitlines()[-1]))
    return case


def plot(results: List[Dict[str, Any]], path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl in sorted({r["impl"] for r in results}):
        for d in sorted({r["dim"] for r in results}):
            pts = [(r["batch"], r["growth_mib"]) for r in results if r["impl"] == impl and r["dim"] == d and r["status"] == "ok"]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=f"{impl}, D={d}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("peak RSS growth, forward+backward (MiB)")
    ax.set_title("CLIP loss memory on the CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _cases(text: str) -> List[Tuple[int, int]]:
    """``"32768x64,4096x8"`` -> ``[(32768, 64), (4096, 8)]``; ``""`` -> ``[]``."""
    out = []
    for case in filter(None, (c.strip() for c in text.split(","))):
        parts = case.lower().split("x")
        if len(parts) != 2:
            raise argparse.ArgumentTypeError(f"expected BxD cases like 32768x64, got {case!r}")
        out.append((positive_int(parts[0]), positive_int(parts[1])))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="bigbatch bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--dims", type=positive_int, nargs="+", default=[128])
    parser.add_argument("--impls", nargs="+", default=["reference", "torch"], choices=["reference", "torch"])
    parser.add_argument("--extra", type=_cases, default="32768x64",
                        help="extra BxD cases, comma separated, e.g. 32768x64,4096x8 ('' for none)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/memory_cpu.json for the default grid, else a temporary file)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        impl, b, d, seed = args.child
        print(json.dumps(_child(impl, int(b), int(d), int(seed))))
        return 0
    out = Path(output_path(parser, args, "benchmarks/results/memory_cpu.json", "memory_cpu.json",
                           ["batches", "dims", "impls", "extra"]))
    grid = [(b, d) for d in args.dims for b in args.batches]
    grid += args.extra
    results = []
    for b, d in grid:
        for impl in args.impls:
            case = run_case(impl, b, d)
            results.append(case)
            shown = f"{case['growth_mib']:9.1f} MiB in {case['seconds']:6.1f} s" if case["status"] == "ok" else case.get("reason", case["status"])
            print(f"B={b:>7} D={d:>4} {impl:>9}: {shown}", flush=True)
    payload = {"benchmark": "clip_loss forward+backward, peak RSS growth", "hardware": hardware(), "results": results}
    write_json(out, payload)
    png = plot(results, out.with_suffix(".png"))
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    failed = [r for r in results if r["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
