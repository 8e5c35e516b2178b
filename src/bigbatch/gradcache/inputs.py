"""Encoder inputs that require grad (soft prompts, adapter outputs, attribution) get exact
gradients across chunks.

Each such tensor is replaced for the step by a *boundary*: a detached leaf that requires grad.
Chunks are views of the boundary, so every chunk's backward accumulates its rows into
``boundary.grad``; at the end one backward carries ``boundary.grad`` into the original tensor,
crossing an upstream graph (the input being another module's output) exactly once, as the
full-batch backward would. Memory: one gradient the size of each such input.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch
from torch import Tensor

from .chunking import map_tensors, tensor_leaves

Pairs = List[Tuple[Tensor, Tensor]]  # (original, boundary)


def inputs_require_grad(x: Any) -> bool:
    return any(t.requires_grad for t in tensor_leaves(x))


def with_boundaries(x: Any, leaves_too: bool) -> Tuple[Any, Pairs]:
    """``x`` with its tensors that require grad replaced by boundaries (non-leaf ones only, unless
    ``leaves_too``: a leaf's chunk views already accumulate into its own ``.grad``)."""
    pairs: Pairs = []

    def swap(t: Tensor) -> Tensor:
        if t.requires_grad and (leaves_too or t.grad_fn is not None):
            b = t.detach().requires_grad_()
            pairs.append((t, b))
            return b
        return t

    return map_tensors(x, swap), pairs


def backward_into_originals(pairs: Pairs) -> None:
    """Carry each boundary's accumulated gradient into its original tensor (one backward)."""
    got = [(o, b.grad) for o, b in pairs if b.grad is not None]
    if got:
        torch.autograd.backward([o for o, _ in got], [g for _, g in got])
