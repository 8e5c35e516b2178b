"""Random-state capture and replay, so a chunk's second forward sees the random draws of its first.

Captured before the first forward of a chunk and restored, inside a fork, before its re-run:
torch's CPU generator, the generator of every CUDA device the chunk can touch (its input
tensors' devices and the model's parameter devices), and Python's ``random`` and NumPy's global
states (a model may draw from them, e.g. a layer-drop decision with ``random.uniform``). The fork
restores the caller's states afterwards, so replaying never disturbs the random streams of the
training loop: after a cached step the global generators are exactly where an ordinary forward
over the same chunks leaves them.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import sys
import threading
from typing import Any, Iterable, Iterator, List, Optional

import torch
from torch import Tensor, nn

from . import walk


def cuda_devices_of(tensors: Iterable[Tensor]) -> List[int]:
    """Sorted indices of the CUDA devices among ``tensors`` (empty without CUDA)."""
    return sorted({t.device.index for t in tensors if t.is_cuda and t.device.index is not None})


def model_cuda_devices(model: nn.Module) -> List[int]:
    """The CUDA devices holding any parameter or buffer of ``model`` -- a model split over GPUs
    (hand-made model parallel, ``device_map="auto"``) draws its dropout on each of them -- and
    those of every ``nn.DataParallel`` in it, whose replicas draw on theirs."""
    devices = set(cuda_devices_of(itertools.chain(walk.parameters(model), walk.buffers(model))))
    for m in walk.submodules(model):
        if isinstance(m, nn.DataParallel):
            devices.update(d if isinstance(d, int) else torch.device(d).index for d in (m.device_ids or ()))
    return sorted(devices)


def _numpy_random() -> Optional[Any]:
    """``numpy.random`` if NumPy is already imported (never imports it)."""
    np = sys.modules.get("numpy")
    return getattr(np, "random", None) if np is not None else None


_REPLAY_LOCK = threading.RLock()  # see RngState.replay


@contextlib.contextmanager
def forked_rng(devices: Iterable[int] = ()) -> Iterator[None]:
    """Run the body, then put every generator above back where it was on entry."""
    np_random = _numpy_random()
    py_state = random.getstate()
    np_state = np_random.get_state() if np_random is not None else None
    try:
        with torch.random.fork_rng(devices=sorted(set(devices)), enabled=True):
            yield
    finally:
        random.setstate(py_state)
        if np_state is not None:
            np_random.set_state(np_state)


class RngState:
    """torch's CPU and per-CUDA-device generator states, Python's and NumPy's, at one moment.

    Capture costs one small tensor per torch generator and Python's and NumPy's state (a few KB
    each); nothing is kept beyond that.
    """

    __slots__ = ("cpu", "devices", "cuda", "py", "np")

    def __init__(self, devices: Iterable[int] = ()) -> None:
        self.cpu: Tensor = torch.get_rng_state()
        self.devices: List[int] = sorted(set(devices))
        self.cuda: List[Tensor] = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.py = random.getstate()
        np_random = _numpy_random()
        self.np = np_random.get_state() if np_random is not None else None

    def restore(self) -> None:
        """Set every generator to the captured state (no fork: inside :meth:`replay`, or a caller's)."""
        torch.set_rng_state(self.cpu)
        for d, s in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(s, d)
        random.setstate(self.py)
        np_random = _numpy_random()
        if self.np is not None and np_random is not None:
            np_random.set_state(self.np)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with the captured states; the caller's states are restored on exit.

        One replay at a time per process: the CPU, Python and NumPy generators are process-wide, and
        autograd runs the backward of graphs on different GPUs in one thread per device, so two
        ``cached_encode`` nodes (encoders on cuda:0 and cuda:1) re-run their chunks concurrently and
        would each replay into, and restore, the other's state. The lock covers a chunk's re-run
        forward only (not its backward, which may need the other device's thread)."""
        with _REPLAY_LOCK, forked_rng(self.devices):
            self.restore()
            yield
