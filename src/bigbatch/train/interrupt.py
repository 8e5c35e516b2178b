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
