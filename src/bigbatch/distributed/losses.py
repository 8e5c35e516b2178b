"""CLIP and InfoNCE losses over a process group: cross-rank checks, then the ring (or gather).

Returned values follow the distributed contract (docs/ring.md): every rank returns the global loss
(one scalar all_reduce of the ranks' ``world_size`` x shares, detached: a NaN anywhere is a NaN
everywhere), and its backward yields its share of every gradient (that of ``world_size`` x its
share), so that DDP-style averaging of parameter gradients
over ranks gives exactly the single-process gradient over the whole batch, also with
shards of different sizes. With ``reduction="none"`` the per-query losses of this rank's
queries are returned as they are (they are the global loss's terms); their backward
still sums over ranks, so under gradient averaging scale a sum of them by world_size.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validate import check_int_vector, label_range
from ..backends.base import TileBackend, compute_dtype
from .gather import gather_rows_with_grad
from .ring import Ring, agree, dtype_code, error_message, global_value, offsets
from .softmax import RingPlan, grad_chunk_rows, own_positives, positive_index, ring_softmax_stats

Backend = Union[str, TileBackend]

_KIND = {"clip": 1.0, "infonce": 2.0}
_REDUCTION = {"mean": 1.0, "sum": 2.0, "none": 3.0}


def _local_label_error(labels: Optional[Tensor], b: int, n: int,
                       device: torch.device) -> Tuple[Optional[Exception], float, float]:
    """(this rank's labels' error or None, min label, max label); never raises."""
    if labels is None:
        if n < b:
            return (
                ValueError(f"labels=None pairs query i with key i of the same rank, so keys needs at least as many "
                           f"rows as queries on every rank ({b}), got {n}; pass labels (global key indices) instead"),
                0.0,
                0.0,
            )
        return None, 0.0, 0.0
    try:
        check_int_vector(labels, b, device, name="labels", meaning="one positive key per query", what="global key indices")
    except Exception as exc:  # any local failure is shared below, so no rank is left waiting
        return exc, 0.0, 0.0
    lo, hi = label_range(labels)
    return None, float(lo), float(hi)


# What every rank contributes to the one metadata all_gather of a call (see :func:`_agree`).
_FIELDS = ("kind", "reduction", "path", "needs_backward", "dim", "dtype", "scale", "grad_chunk",
           "q_rows", "k_rows", "has_labels", "label_min", "label_max")


def _named(codes: Mapping[str, float]) -> Callable[[float], str]:
    names = {v: k for k, v in codes.items()}
    return lambda v: repr(names.get(v, v))


# how a field that differs between ranks is named in the error (codes shown as what was passed)
_SHOWN = {
    "kind": ("the loss (clip_loss or infonce_loss)", _named(_KIND)),
    "reduction": ("reduction", _named(_REDUCTION)),
    "path": ("the backend's kind ('reference' gathers, a tile backend runs the ring)",
             _named({"reference": 0.0, "a tile backend": 1.0})),
    "needs_backward": ("whether a gradient is wanted (grad mode on and an input that requires grad)",
                       _named({"no": 0.0, "yes": 1.0})),
}


def _grad_chunk_error(chunk: Any) -> Optional[str]:
    """Checked before the exchange (a rank that raised alone would leave the others in the ring)."""
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        return f"grad_chunk must be a positive int or None, got {chunk!r}"
    return None


def raise_on_every_rank(group, kind: str, exc: Exception, device: Optional[torch.device] = None) -> None:
    """Re-raise ``exc`` (this rank's invalid input, found before the ring) after joining the
    metadata exchange that the other ranks' ``{kind}_loss(group=...)`` calls are waiting in, so that
    they raise a ``ValueError`` naming this rank's problem instead of hanging."""
    ring = Ring.of(group)
    try:  # (on the group's metadata device: ring.exchange_device; ``device``, the features', if any)
        agree(ring, device or torch.device("cpu"), dict.fromkeys(_FIELDS, 0.0),
              local_error=error_message(exc), what=f"{kind}_loss(group=...)")
    except ValueError:
        pass  # the collective's error names every failing rank; this rank raises its own below
    raise exc


def _agree(ring: Ring, q: Tensor, k: Tensor, scale: Tensor, *, kind: str, reduction: str,
           path: Backend, local_error: Optional[str], lo: float, hi: float, has_labels: bool,
           grad_chunk: Optional[int] = None) -> dict:
    local_error = local_error or _grad_chunk_error(grad_chunk)
    fields = {
        "kind": _KIND[kind],
        "reduction": _REDUCTION[reduction],
        "path": 0.0 if isinstance(path, str) else 1.0,  # gather vs ring: different collectives
        # the backward is a collective too: every rank runs it or none does (else: a hang)
        "needs_backward": 1.0 if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                or scale.requires_grad)) else 0.0,
        "dim": float(q.shape[1]),
        "dtype": float(dtype_code(q.dtype)),
        "scale": float(scale.detach()),
        # the ring's backward messages are cut by it (the default follows D, agreed above): ranks
        # with different values would exchange messages of different sizes (gloo aborts the
        # process); the gather path does not use it
        "grad_chunk": float(grad_chunk or grad_chunk_rows(q.shape[1]))
        if local_error is None and not isinstance(path, str) else 0.0,
        "q_rows": float(q.shape[0]),
        "k_rows": float(k.shape[0]),
        "has_labels": 1.0 if has_labels else 0.0,
        "label_min": lo,
        "label_max": hi,
    }
    assert tuple(fields) == _FIELDS, "keep raise_on_every_rank's fields in step with this exchange"
    table = agree(
        ring,
        q.device,
        fields,
        same=("kind", "reduction", "path", "needs_backward", "dim", "dtype", "scale", "grad_chunk"),
        local_error=local_error,
        what=f"{kind}_loss(group=...)",
        p2p=not isinstance(path, str),  # the ring; "reference" gathers
        shown=_SHOWN,
    )
    if "path" in table and len(set(table["path"])) > 1:  # pragma: no cover - agree() checks it
        raise ValueError("backend must be 'reference' on all ranks or a tile backend on all ranks")
    return table


def _plan(ring: Ring, table: dict, q: Tensor, labels: Optional[Tensor], *, cols: bool,
          chunk: Optional[int]) -> RingPlan:
    chunk = chunk or grad_chunk_rows(q.shape[1])  # checked and agreed in _agree
    q_sizes = [int(v) for v in table["q_rows"]]
    k_sizes = [int(v) for v in table["k_rows"]]
    if cols:  # CLIP: every positive is in this rank's own block, no sync needed
        pos = own_positives(q.shape[0], ring.rank, chunk, q.device)
        start = sum(k_sizes[: ring.rank])
        labels = torch.arange(start, start + q.shape[0], device=q.device)
    else:
        pos = positive_index(labels, k_sizes, chunk)
    return RingPlan(ring, q_sizes, k_sizes, cols, chunk, pos, labels.long())


def _checked(kind: str, q: Tensor, k: Tensor, scale: Any, backend: Any, group: Any, reduction: str = "mean"):
    """The public entry points' input checks (those of ``bigbatch.clip_loss`` / ``infonce_loss``,
    raised on every rank): ``(group, scale as a 0-d tensor, backend resolved)``."""
    from .._validate import require_group
    from ..functional import _check_inputs

    group = require_group(group, kind)
    names = ("image_features", "text_features") if kind == "clip" else ("queries", "keys")
    s, impl = _check_inputs(names[0], q, names[1], k, scale, backend, same_rows=False, group=group, kind=kind,
                            reduction=reduction)
    return group, s, impl


def ring_clip_loss(
    image: Tensor, text: Tensor, scale: Any, *, group, backend: Any = "auto", grad_chunk: Optional[int] = None
) -> Tensor:
    """Symmetric CLIP loss over the global batch of ``group``; see the module doc for semantics.

    ``image``/``text``: this rank's shard (b_r x D each, same b_r; b_r may differ between ranks).
    ``scale``: a float or 0-d tensor (may require grad). ``backend``: as ``bigbatch.clip_loss``'s
    (``"reference"``: gather-with-grad, full matrices; a tile backend: the ring). ``grad_chunk``:
    rows/cols per backward backend call (default: 32 MiB of fp32 gradient per call). Inputs are
    checked as ``bigbatch.clip_loss(..., group=group)`` checks them, which is this with the default
    ``grad_chunk``.
    """
    group, scale, backend = _checked("clip", image, text, scale, backend, group)
    return clip_over_group(image, text, scale, group=group, backend=backend, grad_chunk=grad_chunk)


def clip_over_group(image: Tensor, text: Tensor, scale: Tensor, *, group, backend: Backend,
                    grad_chunk: Optional[int] = None) -> Tensor:
    """:func:`ring_clip_loss` on checked inputs: ``scale`` a 0-d tensor in the compute dtype,
    ``backend`` ``"reference"`` or a tile backend."""
    ring = Ring.of(group)
    b, n = image.shape[0], text.shape[0]
    err = None
    if b != n:
        err = (f"image_features and text_features must have the same number of rows on each rank "
               f"(row i of one is the positive of row i of the other), got {b} and {n}")
    table = _agree(ring, image, text, scale, kind="clip", reduction="mean", path=backend,
                   local_error=err, lo=0.0, hi=0.0, has_labels=False, grad_chunk=grad_chunk)
    sizes = [int(v) for v in table["q_rows"]]
    total = sum(sizes)
    start = offsets(sizes)[ring.rank]
    if isinstance(backend, str):
        ct = compute_dtype(image.dtype)
        (image, text, scale), (all_image, all_text, _) = gather_rows_with_grad([image, text, scale], ring,
                                                                               [sizes, sizes, None], ct)
        labels = torch.arange(start, start + b, device=image.device)
        per_image = F.cross_entropy(scale * (image @ all_text.t()), labels, reduction="sum")
        per_text = F.cross_entropy(scale * (text @ all_image.t()), labels, reduction="sum")
        return global_value(ring, (per_image + per_text) * (ring.world / (2.0 * total)))
    plan = _plan(ring, table, image, None, cols=True, chunk=grad_chunk)
    lse_row, lse_col, pos = ring_softmax_stats(image, text, scale, plan, backend)
    return global_value(ring, (lse_row.sum() + lse_col.sum() - 2.0 * pos.sum()) * (ring.world / (2.0 * total)))


def ring_infonce_loss(
    q: Tensor,
    k: Tensor,
    scale: Any,
    *,
    labels: Optional[Tensor] = None,
    reduction: str = "mean",
    group,
    backend: Any = "auto",
    grad_chunk: Optional[int] = None,
) -> Tensor:
    """InfoNCE over the global batch of ``group``: queries of every rank against keys of every rank.

    ``labels`` (b_r,) index the GLOBAL key set (all ranks' keys in group-rank order); ``None``
    pairs query i with key i of the same rank. ``reduction``: ``"mean"`` / ``"sum"`` return
    the global mean / sum (backward: this rank's share); ``"none"`` this rank's per-query losses.
    Other arguments and checks as :func:`ring_clip_loss`.
    """
    group, scale, backend = _checked("infonce", q, k, scale, backend, group, reduction)
    return infonce_over_group(q, k, scale, labels=labels, reduction=reduction, group=group, backend=backend,
                              grad_chunk=grad_chunk)


def infonce_over_group(q: Tensor, k: Tensor, scale: Tensor, *, labels: Optional[Tensor], reduction: str, group,
                       backend: Backend, grad_chunk: Optional[int] = None) -> Tensor:
    """:func:`ring_infonce_loss` on checked inputs (see :func:`clip_over_group`)."""
    ring = Ring.of(group)
    b, n = q.shape[0], k.shape[0]
    err, lo, hi = _local_label_error(labels, b, n, q.device)
    try:
        table = _agree(ring, q, k, scale, kind="infonce", reduction=reduction, path=backend,
                       local_error=error_message(err) if err is not None else None,
                       lo=lo, hi=hi, has_labels=labels is not None, grad_chunk=grad_chunk)
    except ValueError:
        if err is not None:  # as raise_on_every_rank: the failing rank raises its own exception
            raise err from None
        raise
    k_sizes = [int(v) for v in table["k_rows"]]
    n_total = sum(k_sizes)
    bad = [r for r in range(ring.world)
           if table["has_labels"][r] and (table["label_min"][r] < 0 or table["label_max"][r] >= n_total)]
    if bad:
        ranges = ", ".join(f"rank {r}: [{int(table['label_min'][r])}, {int(table['label_max'][r])}]" for r in bad)
        raise ValueError(
            f"infonce_loss(group=...): labels must index the global key set [0, {n_total}) "
            f"(keys of all ranks in group-rank order), got values in {ranges}"
        )
    if labels is None:
        start = offsets(k_sizes)[ring.rank]
        labels = torch.arange(start, start + b, device=q.device)
    labels = labels.long()
    total_q = sum(int(v) for v in table["q_rows"])
    if isinstance(backend, str):
        ct = compute_dtype(q.dtype)
        (q, _, scale), (_, all_keys, _) = gather_rows_with_grad([q, k, scale], ring, [None, k_sizes, None], ct)
        per_row = F.cross_entropy(scale * (q @ all_keys.t()), labels, reduction="none")
    else:
        plan = _plan(ring, table, q, labels, cols=False, chunk=grad_chunk)
        lse_row, _, pos = ring_softmax_stats(q, k, scale, plan, backend)
        per_row = lse_row - pos
    if reduction == "none":
        return per_row
    if reduction == "sum":
        return global_value(ring, per_row.sum() * float(ring.world))
    return global_value(ring, per_row.sum() * (ring.world / float(total_q)))
