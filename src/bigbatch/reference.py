"""Full-matrix implementations: the truth for tests and benchmarks.

They materialise the B x N logits (O(B*N) memory), compute in float32 for
half/single inputs and float64 for float64 inputs, and rely on plain autograd.
Call them with float64 inputs to get the float64 reference the tests compare to.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ._validate import check_reduction
from .backends.base import compute_dtype

Scalar = Union[float, Tensor]


def logits(q: Tensor, k: Tensor, scale: Scalar) -> Tensor:
    """``scale * q @ k.T`` in the compute dtype (B x N)."""
    ct = compute_dtype(q.dtype)
    return scale * (q.to(ct) @ k.to(ct).t())


def infonce_per_row(q: Tensor, k: Tensor, scale: Scalar, labels: Optional[Tensor] = None) -> Tensor:
    """``LSE_j(S_ij) - S_{i, labels_i}`` for each query row (labels default to arange(B))."""
    s = logits(q, k, scale)
    if labels is None:
        labels = torch.arange(q.shape[0], device=q.device)
    return F.cross_entropy(s, labels, reduction="none")


def infonce_loss(
    q: Tensor, k: Tensor, scale: Scalar, labels: Optional[Tensor] = None, reduction: str = "mean"
) -> Tensor:
    check_reduction(reduction)  # an unknown name fell through to the per-row losses
    per_row = infonce_per_row(q, k, scale, labels)
    return {"mean": per_row.mean, "sum": per_row.sum}.get(reduction, lambda: per_row)()


def clip_loss(image: Tensor, text: Tensor, scale: Scalar) -> Tensor:
    """OpenCLIP's symmetric loss: mean of image->text and text->image cross-entropy."""
    s = logits(image, text, scale)
    labels = torch.arange(image.shape[0], device=image.device)
    return 0.5 * (F.cross_entropy(s, labels) + F.cross_entropy(s.t(), labels))


def siglip_loss(image: Tensor, text: Tensor, scale: Scalar, bias: Scalar, labels: Optional[Tensor] = None) -> Tensor:
    """OpenCLIP's SigLipLoss: ``-sum_ij log sigmoid(z_ij (scale * image_i.text_j + bias)) / B``.

    ``z = +1`` on positives (the diagonal, or ``labels[i] == labels[j]`` when labels are given),
    ``-1`` elsewhere; normalised by the batch size B, as OpenCLIP does.
    """
    s = logits(image, text, scale) + bias
    if labels is None:
        pos = torch.eye(image.shape[0], text.shape[0], dtype=torch.bool, device=image.device)
    else:
        pos = labels[:, None] == labels[None, :]
    z = pos.to(s.dtype) * 2 - 1
    return -F.logsigmoid(z * s).sum() / image.shape[0]
