"""Run a function in N real processes joined by a gloo process group (CPU).

``run_gloo(fn, world_size, *args)`` spawns ``world_size`` processes, each calls
``fn(rank, world_size, *args)`` after ``init_process_group("gloo")``, and returns the
list of per-rank return values (they must be picklable; tensors are fine). An
exception on any rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    result: Any
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report every failure to the parent, whatever it is
        result = ("error", traceback.format_exc())
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # The group is destroyed and the result is on disk: leave without running C++ static
    # destructors. torch's gloo p2p threads can call std::terminate during interpreter teardown
    # ("terminate called without an active exception", seen at exit AFTER destroy_process_group
    # returned), which would fail a run whose collectives all completed.
    os._exit(0)


def run_gloo(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> List[Any]:
    """Per-rank results of ``fn(rank, world_size, *args)`` run under a gloo group."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _worker, args=(world_size, _free_port(), outdir, fn, args), nprocs=world_size, join=False, start_method="spawn"
        )
        # ctx.join returns False as soon as ONE process exits while others still run, so
        # loop until all have exited or the deadline passes.
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise AssertionError(f"gloo processes did not finish within {timeout:.0f} s (a hang in a collective?)")
        results = []
        for rank in range(world_size):
            with open(os.path.join(outdir, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
