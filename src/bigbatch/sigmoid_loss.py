"""The autograd Function of the sigmoid (SigLIP) loss, and the choice of its backend.

The loss needs no global statistic, so the forward pass produces the loss AND every gradient in
one pass over the tiles (``backend.sigmoid_pass``); it keeps ``dq``, ``dk`` (O((M+N)*D), compute
dtype) and the two scalar gradients, and the backward only multiplies them by the incoming
gradient. Without any gradient to compute, the forward is a loss-only pass (a third of the work).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .backends import resolve_backend
from .backends.base import SigmoidBackend, compute_dtype
from ._validate import check_int_vector
from ._amp import autocast_off
from ._autograd import distinct, first_order, transformed

SigmoidBackendArg = Union[str, SigmoidBackend]


def resolve_sigmoid_backend(backend: object, device: torch.device, dtype: torch.dtype) -> Union[str, SigmoidBackend]:
    """``"reference"`` or a :class:`~bigbatch.backends.base.SigmoidBackend` usable on ``device``."""
    return resolve_backend(backend, device, dtype, op="sigmoid")


class SigmoidLoss(torch.autograd.Function):
    """``norm * sum_ij softplus(-z_ij (scale q_i.k_j + bias))`` with all gradients from the forward pass."""

    @staticmethod
    def forward(ctx, q, k, scale, bias, ids, backend, norm: float):
        ct = compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=ct, device=q.device)
        dk = torch.zeros(k.shape, dtype=ct, device=k.device)
        loss, g_sum = backend.sigmoid_pass(q, k, scale, bias, q_ids=ids, k_ids=ids, diagonal=0, dq_acc=dq, dk_acc=dk)
        # d(loss)/d(scale) = sum_ij G_ij (q k^T)_ij = sum_i q_i . (G k)_i: O(M*D) from the unscaled dq.
        d_scale = torch.dot(q.reshape(-1).to(ct), dq.reshape(-1)).mul_(norm)
        factor = scale * norm
        dq.mul_(factor)
        dk.mul_(factor)
        ctx.in_dtype = q.dtype
        ctx.save_for_backward(dq, dk, d_scale, g_sum.mul_(norm))
        return loss * norm  # out of place: see tiled_lse.positive_logits

    @staticmethod
    @first_order
    @autocast_off
    def backward(ctx, grad: Tensor):
        dq, dk, d_scale, d_bias = ctx.saved_tensors
        g = grad.to(dq.dtype)
        return (
            (dq * g).to(ctx.in_dtype),
            (dk * g).to(ctx.in_dtype),
            (d_scale * g),
            (d_bias * g),
            None,
            None,
            None,
        )


def sigmoid_loss_sum(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    bias: Tensor,
    backend: SigmoidBackend,
    *,
    ids: Optional[Tensor] = None,
    norm: float = 1.0,
) -> Tensor:
    """``norm * sum_ij -log sigmoid(z_ij u_ij)`` over q x k (differentiable in q, k, scale, bias).

    Positives: ``ids[i] == ids[j]`` when ``ids`` is given (then q and k have equal rows), else i == j.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, scale, bias))
    if needs_grad or transformed(q, k, scale, bias):
        return SigmoidLoss.apply(*distinct(q, k, scale, bias, ids), backend, norm)
    loss, _ = backend.sigmoid_pass(q, k, scale, bias, q_ids=ids, k_ids=ids, diagonal=0)
    return loss * norm


def check_class_ids(labels: object, b: int, device: torch.device, *, name: str = "labels") -> Optional[Tensor]:
    """``None`` or a (b,) integer tensor of class ids on ``device`` (equal ids are positive pairs)."""
    if labels is None:
        return None
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name} must be None or a torch.Tensor of integer class ids, got {type(labels).__name__}")
    labels = check_int_vector(labels, b, device, name=name, meaning="one class id per image/text pair", what="class ids")
    return labels.long().contiguous()
