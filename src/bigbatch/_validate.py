"""Input checks shared by every loss. Each error names the argument and what was expected."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .backends.base import compute_dtype

FEATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
REDUCTIONS = ("mean", "sum", "none")

ScaleArg = Union[float, Tensor]


def check_features(name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (batch, dim), got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}: call .to_dense()")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (batch, dim), got shape {tuple(x.shape)}")
    if x.dtype not in FEATURE_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype among float16, bfloat16, float32, float64; got {x.dtype}"
        )
    if x.shape[0] == 0:
        raise ValueError(f"{name} must have at least one row (an empty batch has no loss; with group=, every rank's "
                         f"shard needs one), got shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} must have at least one feature column, got shape {tuple(x.shape)}")
    return x


def check_pair(q_name: str, q: Tensor, k_name: str, k: Tensor, *, same_rows: bool) -> None:
    """Validate two feature matrices that are multiplied together."""
    check_features(q_name, q)
    check_features(k_name, k)
    if q.device != k.device:
        raise ValueError(f"{q_name} and {k_name} must be on the same device, got {q.device} and {k.device}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{q_name} and {k_name} must have the same feature dimension, got {q.shape[1]} and {k.shape[1]}"
        )
    if q.dtype != k.dtype:
        raise TypeError(f"{q_name} and {k_name} must have the same dtype, got {q.dtype} and {k.dtype}")
    if same_rows and q.shape[0] != k.shape[0]:
        raise ValueError(
            f"{q_name} and {k_name} must have the same batch size (row i of one is the positive of "
            f"row i of the other), got {q.shape[0]} and {k.shape[0]}"
        )


def prepare_scalar(name: str, value: object, like: Tensor) -> Tensor:
    """A python number or 1-element floating tensor -> 0-d tensor in the compute dtype on like's device.

    The conversion is differentiable, so a parameter (e.g. ``logit_scale.exp()``) gets its gradient.
    A 0-d tensor on the CPU is accepted with CUDA features, as torch does for scalars.
    """
    ct = compute_dtype(like.dtype)
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and value.dtype.kind in "iuf":
        value = value.item()  # a 0-d numpy array, as numpy scalars are accepted
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Tensor)):
        raise TypeError(f"{name} must be a float or a 0-d floating tensor, got {type(value).__name__}")
    if isinstance(value, numbers.Real):
        if torch.compiler.is_compiling():
            # under torch.compile a changing python scale becomes a symbolic float: host checks on it
            # would break a fullgraph; a NaN/inf scale still gives a NaN/inf loss through the arithmetic
            return torch.full((), value, dtype=ct, device=like.device)
        try:
            as_float = float(value)
        except OverflowError:  # an int beyond float range
            raise ValueError(f"{name} must be finite in float64, got an int of {int(value).bit_length()} bits") from None
        if not math.isfinite(as_float):
            raise ValueError(f"{name} must be finite, got {value!r}")
        if abs(as_float) > torch.finfo(ct).max:
            raise ValueError(f"{name} must be finite in the loss's compute dtype {ct} (|{name}| <= "
                             f"{torch.finfo(ct).max:.4g}), got {value!r}")
        return torch.tensor(as_float, dtype=ct, device=like.device)
    if value.numel() != 1:  # any shape of one element: (), (1,), (1, 1), as OpenCLIP's modules take
        raise ValueError(f"{name} must be a scalar (0-d or 1-element tensor), got shape {tuple(value.shape)}")
    if value.dtype == torch.bool or value.is_complex():  # integer tensors are promoted, as OpenCLIP's modules do
        raise TypeError(f"{name} must be a real floating (or integer) tensor, got dtype {value.dtype}")
    if value.device != like.device and not (value.device.type == "cpu" and value.dim() == 0):
        raise ValueError(f"{name} must be on the features' device {like.device}, got {value.device}")
    return value.reshape(()).to(device=like.device, dtype=ct)


def check_int_vector(x: object, b: int, device: torch.device, *, name: str, meaning: str, what: str) -> Tensor:
    """An integer tensor of shape (b,) on ``device``; ``what`` names the elements, ``meaning`` their role."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer {what}, got {type(x).__name__}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype (e.g. torch.long), got {x.dtype}")
    if x.shape != (b,):
        raise ValueError(f"{name} must have shape ({b},) ({meaning}), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} must be on the features' device {device}, got {x.device}")
    return x


def as_signed(labels: Tensor) -> Tensor:
    """Integer labels in a dtype torch's reductions take: uint16/32/64 (no min/max kernels) as int64."""
    return labels if labels.dtype.is_signed or labels.dtype == torch.uint8 else labels.to(torch.int64)


def label_range(labels: Tensor) -> Tuple[int, int]:
    """(min, max) of integer ``labels`` as the caller wrote them: uint64 values of 2**63 or more,
    which wrap to negative in the int64 that the reductions take, are read back unsigned (extra
    syncs only then, i.e. for labels that are out of range anyway)."""
    signed = as_signed(labels)
    lo, hi = (int(v) for v in torch.aminmax(signed))
    if lo < 0 and labels.dtype == getattr(torch, "uint64", None):
        wrapped, plain = signed[signed < 0], signed[signed >= 0]
        hi = int(wrapped.max()) + 2**64
        lo = int(plain.min()) if plain.numel() else int(wrapped.min()) + 2**64
    return lo, hi


def check_labels(labels: object, b: int, n: int, device: torch.device, *, name: str = "labels") -> Tensor:
    """Integer tensor of shape (b,) with values in [0, n). Reading the range costs one sync."""
    labels = check_int_vector(
        labels, b, device, name=name, meaning="one positive key per query", what="class indices"
    )
    lo, hi = label_range(labels)
    if lo < 0 or hi >= n:
        raise ValueError(f"{name} must index keys in [0, {n}), got values in [{lo}, {hi}]")
    return as_signed(labels).long()


def check_reduction(reduction: object) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction  # type: ignore[return-value]


def reduce(per_row: Tensor, reduction: str) -> Tensor:
    if reduction == "mean":
        return per_row.mean()
    if reduction == "sum":
        return per_row.sum()
    return per_row


def require_group(group: object, loss: str) -> object:
    """An initialised process group for the ring entry point ``ring_{loss}_loss`` (``None`` refused)."""
    group = check_group(group)
    if group is None:
        raise ValueError(f"ring_{loss}_loss needs a process group (group=...); without one use bigbatch.{loss}_loss")
    return group


def check_group(group: object) -> Optional[object]:
    """``None`` (no communication) or an initialised torch.distributed process group."""
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group was given but torch.distributed is not initialised (call init_process_group first)")
    if group is dist.GroupMember.NON_GROUP_MEMBER or (isinstance(group, int) and group == -100):
        # what dist.new_group(ranks) returns on processes that are not in ranks
        raise ValueError(
            f"group: this process (global rank {dist.get_rank()}) is not a member of the given group; "
            f"call the loss only on the group's members"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    return group
