"""Shared measurement helpers for the benchmarks: CUDA-event medians, peak extra memory,
the GPU's matmul rate measured in the same run, out-of-memory recorded as a result,
and JSON output that names the hardware."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch


def hardware() -> Dict[str, Any]:
    """What ran the benchmark: GPU model and count, library versions, CPU."""
    info: Dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def cuda_time_ms(fn: Callable[[], Any], *, warmup: int = 1, repeat: int = 3) -> List[float]:
    """Per-call times in ms with CUDA events, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def wall_time_ms(fn: Callable[[], Any], *, warmup: int = 1, repeat: int = 3) -> List[float]:
    """Per-call wall-clock times in ms (CPU benchmarks; synchronises CUDA if present)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def matmul_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192, repeat: int = 10) -> float:
    """Measured dense matmul rate (TFLOP/s) of an n x n x n product on random data."""
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = statistics.median(cuda_time_ms(lambda: a @ b, warmup=3, repeat=repeat))
    del a, b
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure(
    fn: Callable[[], Any], *, warmup: int = 1, repeat: int = 3, baseline_bytes: Optional[int] = None
) -> Dict[str, Any]:
    """Run ``fn`` on CUDA: median time (ms), all times, and peak memory above the live memory
    before the call (``extra_gib``). Out-of-memory is returned as ``{"status": "oom"}``."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated() if baseline_bytes is None else baseline_bytes
    torch.cuda.reset_peak_memory_stats()
    try:
        times = cuda_time_ms(fn, warmup=warmup, repeat=repeat)
    except torch.cuda.OutOfMemoryError as exc:
        gc.collect()
        torch.cuda.empty_cache()
        return {"status": "oom", "error": str(exc).splitlines()[0]}
    peak = torch.cuda.max_memory_allocated()
    return {
        "status": "ok",
        "median_ms": statistics.median(times),
        "times_ms": times,
        "extra_gib": (peak - base) / 2**30,
    }


def finite_or_null(value: Any) -> Any:
    """``value`` with every NaN/inf float replaced by ``None``: standard JSON has no NaN, and a
    figure that was not measured (a CPU dry run's memory or matmul rate) is null, not a number."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def write_json(path: os.PathLike, payload: Dict[str, Any]) -> Path:
    """``payload`` as standard JSON (non-finite floats as null), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(finite_or_null(payload), indent=2, sort_keys=True, allow_nan=False))
    tmp.replace(path)
    return path


def positive_int(text: str) -> int:
    """An argparse type: a positive integer (sizes, repeats), refused with a clear message."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def output_path(parser: argparse.ArgumentParser, args: argparse.Namespace, committed: str, scratch: str,
                measured: List[str], canonical: bool = True) -> str:
    """Where a run writes its JSON: ``args.out`` when given; else ``committed`` (the results file the
    README's tables come from) only for the canonical run -- every option in ``measured`` at its
    default, and ``canonical`` -- and ``scratch`` in the temporary directory for any other run (a
    subset of the grid, a tuning sweep, a smoke test), so that none replaces the committed numbers."""
    if getattr(args, "out", None):
        return str(args.out)
    # the defaults as parsed (a string default goes through the option's type, e.g. memory's --extra)
    defaults = vars(parser.parse_known_args([])[0])
    changed = [k for k in measured if getattr(args, k) != defaults[k]]
    if canonical and not changed:
        return committed
    path = os.path.join(tempfile.gettempdir(), scratch)
    why = f"--{changed[0].replace('_', '-')} differs from the committed run's" if changed else "not the committed run"
    if os.environ.get("RANK", "0") == "0":  # once under torchrun
        print(f"({why}: writing {path}; --out chooses the path)", flush=True)
    return path
