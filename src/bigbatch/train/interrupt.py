"""Ctrl-C held off while a training step's update is applied and counted.

The loop's ``KeyboardInterrupt`` handler saves "the last completed step". An interrupt that
lands inside ``optimizer.step()`` (part of the parameters updated), or between it and the step
counter (all updated, not yet counted), would save weights that belong to no step boundary, and
the resumed run would apply an update twice. :func:`sigint_deferred` records a SIGINT that
arrives inside its block and re-raises the signal right after it, to whatever handler was
installed before (Python's default raises ``KeyboardInterrupt`` there).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, List

import torch


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """SIGINT during the block is delivered when the block completes (if it raises, its exception
    goes on as it is). Outside the main thread, where Python cannot set signal handlers, the block
    runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: List[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    # Only after a block that completed: an exception leaving it (an update that failed half-way)
    # propagates as it is, not turned into a KeyboardInterrupt whose handler would save the
    # half-applied update as a step boundary; the Ctrl-C is dropped with it.
    if pending:
        signal.raise_signal(signal.SIGINT)


class AgreedStop:
    """Ctrl-C in a run of several processes: recorded, not raised, and agreed on at step boundaries.

    ``torchrun`` forwards a SIGINT to every worker, and each would take its ``KeyboardInterrupt``
    at its own point: one inside the step's ring (a collective), another already in the save's
    barrier, so the two meet different collectives and the run hangs or aborts without saving (3
    of 14 trials in session 12). Once installed, a SIGINT only sets a flag; :meth:`requested`
    (one all_reduce of one number, at each step boundary) tells every rank whether any was
    interrupted, so all of them stop at the same boundary and save it. Further SIGINTs before the
    save change nothing (raising on one rank would bring back the mismatched collectives; a rank blocked in a
    collective could not run a handler anyway): a run whose peer is gone ends by torchrun's own
    escalation (SIGTERM, SIGKILL) or a kill. With one process, or outside the main thread, nothing
    is installed and :meth:`requested` is ``False``."""

    def __init__(self, world: int, device: torch.device) -> None:
        self.world, self.device = world, device
        self.flag = False
        self._previous = None

    def install(self) -> "AgreedStop":
        """Take over SIGINT (several processes, main thread only); returns ``self``."""
        if self.world > 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def remove(self) -> None:
        """Give SIGINT back to the handler before :meth:`install` (idempotent)."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        self.flag = True

    def requested(self) -> bool:
        """Whether any rank was interrupted (a collective: every rank calls it at the same boundary)."""
        if self._previous is None:
            return False
        import torch.distributed as dist

        t = torch.tensor([1.0 if self.flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
