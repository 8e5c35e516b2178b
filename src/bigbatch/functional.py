"""The losses: validate the inputs, pick a backend, assemble the loss from tiled statistics.

Every softmax loss is ``LSE - positive logit``: both come from
:func:`~bigbatch.tiled_lse.tiled_softmax_stats` (tiles, never a B x N tensor), and the
loss is a weighted sum of those vectors, assembled here with plain torch ops.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import Tensor

from . import reference
from ._amp import autocast_off
from ._autograd import refuse_transformed
from ._validate import (
    ScaleArg,
    check_group,
    check_labels,
    check_pair,
    check_reduction,
    prepare_scalar,
    reduce,
)
from .backends import BackendArg, resolve_backend
from .tiled_lse import tiled_softmax_stats


@contextlib.contextmanager
def shared_local_errors(group, kind: str, features: object) -> Iterator[None]:
    """Checks of this rank's input, run before a ring's first collective: with a group, a failure
    is raised on every rank (the others would otherwise wait in that collective); without one, as
    it is. ``features``: this rank's features (their device carries the exchange where it can)."""
    try:
        yield
    except Exception as exc:
        if group is None:
            raise
        from .distributed import raise_on_every_rank

        raise_on_every_rank(group, kind, exc, features.device if isinstance(features, torch.Tensor) else None)


def _check_inputs(q_name, q, k_name, k, scale, backend, *, same_rows, group, kind, reduction="mean"):
    """``(scale tensor, backend)`` after the local checks (shared with every rank of a group)."""
    with shared_local_errors(group, kind, q):
        check_pair(q_name, q, k_name, k, same_rows=same_rows)
        check_reduction(reduction)
        s = prepare_scalar("scale", scale, q)
        if group is not None:  # (on one process the autograd Function refuses them)
            refuse_transformed("the ring losses", q, k, s)
        return s, resolve_backend(backend, q.device, q.dtype)


@autocast_off
def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    scale: ScaleArg,
    *,
    group=None,
    backend: BackendArg = "auto",
) -> Tensor:
    """Symmetric CLIP loss ``(CE(S) + CE(S.T)) / 2`` with ``S = scale * image @ text.T``.

    Args:
        image_features: (B, D) float16/bfloat16/float32/float64.
        text_features: (B, D), same dtype and device; row i is the positive of image row i.
        scale: the logit multiplier (e.g. ``model.logit_scale.exp()``), a float or 0-d tensor;
            it receives a gradient when it requires one.
        group: ``None`` (the local batch is the whole batch) or a process group whose ranks
            each hold a shard of the global batch (see :mod:`bigbatch.distributed`).
        backend: ``"auto"``, ``"reference"``, ``"torch"``, ``"triton"`` or a backend object.

    Returns:
        The scalar loss in float32 (float64 for float64 inputs). Both directions' statistics come
        from one pass over the tiles; memory beyond the inputs is O(B) plus one tile.
    """
    group = check_group(group)
    s, impl = _check_inputs(
        "image_features", image_features, "text_features", text_features, scale, backend,
        same_rows=group is None, group=group, kind="clip",
    )
    if group is not None:
        from .distributed.losses import clip_over_group

        return clip_over_group(image_features, text_features, s, group=group, backend=impl)
    if impl == "reference":
        return reference.clip_loss(image_features, text_features, s)
    diagonal = torch.arange(image_features.shape[0], device=image_features.device)
    lse_row, lse_col, pos = tiled_softmax_stats(image_features, text_features, s, diagonal, impl, rows=True, cols=True)
    return 0.5 * (lse_row.mean() + lse_col.mean()) - pos.mean()


@autocast_off
def infonce_loss(
    queries: Tensor,
    keys: Tensor,
    scale: ScaleArg,
    *,
    labels: Optional[Tensor] = None,
    reduction: str = "mean",
    group=None,
    backend: BackendArg = "auto",
) -> Tensor:
    """One-directional InfoNCE: ``LSE_j(S_ij) - S_{i, labels_i}`` with ``S = scale * queries @ keys.T``.

    Args:
        queries: (B, D) features.
        keys: (N, D) features, N >= 1; extra rows beyond the positives act as hard/extra negatives.
        scale: the logit multiplier, a float or 0-d tensor (gets a gradient when it requires one).
        labels: (B,) integer index of each query's positive key; default ``arange(B)`` (needs N >= B).
            With ``group``, labels index the global key set (keys of all ranks, in rank order).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-query losses, shape (B,)).
        group: ``None`` or a process group (each rank holds a shard of queries and keys). ``"mean"`` /
            ``"sum"`` return the global mean / sum on every rank, and gradients averaged over ranks
            (DDP) are the single-process ones. ``"none"`` returns this rank's queries' terms of the
            global loss: under DDP averaging back-propagate ``rows.sum() * world_size`` (the global
            sum) or ``rows.sum() * world_size / global_query_count`` (the global mean).
        backend: ``"auto"``, ``"reference"``, ``"torch"``, ``"triton"`` or a backend object.
    """
    group = check_group(group)
    s, impl = _check_inputs(
        "queries", queries, "keys", keys, scale, backend, same_rows=False, group=group, kind="infonce",
        reduction=reduction,
    )
    if group is not None:
        from .distributed.losses import infonce_over_group

        return infonce_over_group(queries, keys, s, labels=labels, reduction=reduction, group=group, backend=impl)
    b, n = queries.shape[0], keys.shape[0]
    if labels is None:
        if n < b:
            raise ValueError(
                f"labels=None pairs query i with key i, so keys needs at least as many rows as queries "
                f"({b}), got {n}; pass labels to choose the positives"
            )
        labels = torch.arange(b, device=queries.device)
    else:
        labels = check_labels(labels, b, n, queries.device)
    if impl == "reference":
        return reduce(reference.infonce_per_row(queries, keys, s, labels), reduction)
    lse_row, _, pos = tiled_softmax_stats(queries, keys, s, labels, impl, rows=True, cols=False)
    return reduce(lse_row - pos, reduction)


@autocast_off
def siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    scale: ScaleArg,
    bias: ScaleArg,
    *,
    labels: Optional[Tensor] = None,
    group=None,
    backend="auto",
) -> Tensor:
    """Sigmoid (SigLIP) loss ``-(1/B) sum_ij log sigmoid(z_ij (scale * image_i.text_j + bias))``.

    ``z_ij = +1`` for positive pairs, ``-1`` otherwise; normalised by the batch size B as in
    OpenCLIP's ``SigLipLoss``. One pass over the tiles gives the loss and every gradient.

    Args:
        image_features, text_features: (B, D), same dtype (float16/bfloat16/float32/float64) and device.
        scale: the logit multiplier (e.g. ``model.logit_scale.exp()``), float or 0-d tensor.
        bias: the logit bias (e.g. ``model.logit_bias``), float or 0-d tensor.
        labels: ``None`` (pair i is image i with text i: positives on the diagonal) or a (B,) integer
            tensor of class ids: image i and text j are positive iff ``labels[i] == labels[j]``.
            With ``group``, ids are compared across all ranks' shards.
        group: ``None`` or a process group; each rank holds a shard of the pairs (shards may differ in
            size). Every rank returns the global loss; its backward gives this rank's share
            ``world/B_global * sum over its rows`` of the gradients, so that gradients averaged
            over ranks (DDP) equal the single-process gradients, scale and bias included.
        backend: ``"auto"``, ``"reference"``, ``"torch"``, ``"triton"`` or a sigmoid backend object.
    """
    from .sigmoid_loss import check_class_ids, resolve_sigmoid_backend, sigmoid_loss_sum

    group = check_group(group)
    if group is not None:
        from .distributed.sigmoid import ring_siglip_loss

        return ring_siglip_loss(image_features, text_features, scale, bias, labels=labels, group=group, backend=backend)
    check_pair("image_features", image_features, "text_features", text_features, same_rows=True)
    s = prepare_scalar("scale", scale, image_features)
    b = prepare_scalar("bias", bias, image_features)
    ids = check_class_ids(labels, image_features.shape[0], image_features.device)
    impl = resolve_sigmoid_backend(backend, image_features.device, image_features.dtype)
    if impl == "reference":
        return reference.siglip_loss(image_features, text_features, s, b, ids)
    return sigmoid_loss_sum(image_features, text_features, s, b, impl, ids=ids, norm=1.0 / image_features.shape[0])
