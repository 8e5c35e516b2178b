"""Random-state capture and replay, so a chunk's second forward sees the dropout masks of its first.

The CPU generator and the generator of every CUDA device the chunk can touch (its input
tensors' devices and the model's parameter devices) are captured before the first forward of a
chunk and restored, inside a fork, before its re-run. The fork restores the caller's states
afterwards, so replaying never disturbs the random stream of the training loop: after a cached
step the global generators are exactly where an ordinary forward over the same chunks leaves them.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List

import torch
from torch import Tensor


def cuda_devices_of(tensors: Iterable[Tensor]) -> List[int]:
    """Sorted indices of the CUDA devices among ``tensors`` (empty without CUDA)."""
    return sorted({t.device.index for t in tensors if t.is_cuda and t.device.index is not None})


class RngState:
    """The CPU and per-CUDA-device generator states at one moment.

    Capture costs one small tensor per generator (a few KB); nothing is kept beyond that.
    """

    __slots__ = ("cpu", "devices", "cuda")

    def __init__(self, devices: Iterable[int] = ()) -> None:
        self.cpu: Tensor = torch.get_rng_state()
        self.devices: List[int] = sorted(set(devices))
        self.cuda: List[Tensor] = [torch.cuda.get_rng_state(d) for d in self.devices]

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with the captured states; the caller's states are restored on exit."""
        with torch.random.fork_rng(devices=self.devices, enabled=True):
            torch.set_rng_state(self.cpu)
            for d, s in zip(self.devices, self.cuda):
                torch.cuda.set_rng_state(s, d)
            yield
