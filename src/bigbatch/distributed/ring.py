"""Communication primitives for ring losses over ``torch.distributed``.

Everything that talks to other ranks lives here; the loss Functions
(:mod:`bigbatch.distributed.softmax`, the sigmoid ring) only call:

* :meth:`Ring.of` -- a process group seen as a ring: this rank sends to ``next``
  and receives from ``prev`` (group ranks mapped to global ranks, so any group
  works, not only WORLD). Raises ``ValueError`` if this process is not a member.
* :meth:`Ring.shift` -- post a batched ``isend`` of some tensors to ``next`` and
  ``irecv`` of some tensors from ``prev`` (one ``batch_isend_irecv`` call);
  returns a :class:`Pending` whose ``wait()`` must be called before the received
  tensors are read or the sent ones are overwritten or freed. Compute issued
  between ``shift`` and ``wait`` overlaps the transfer (NCCL runs it on its own
  stream; gloo on its own threads).
* :func:`agree` -- one small ``all_gather`` of per-rank metadata (sizes, D,
  dtype, flags, a scale value) so that every rank sees every rank's shard sizes,
  and so that inconsistent or invalid input raises the SAME ``ValueError`` on
  every rank instead of one rank raising while the others hang in a collective.
* :func:`offsets` -- where each rank's shard starts in the global batch.

Ring schedule used by the losses: at step ``t`` (0 <= t < world) the block this
rank holds is the one owned by group rank ``ring.block_at(t) = (rank - t) % world``.
Sending the block to ``next`` while computing on it means that after
``world - 1`` shifts every rank has seen every block, one at a time: memory per
rank is O(largest shard), never O(global batch x D).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends.base import cuda_device_current

__all__ = ["Pending", "Ring", "agree", "device_code", "dtype_code", "exchange_device", "global_value", "offsets"]

# Stable small integers for dtypes (exchanged as metadata): the feature dtypes first, then the
# others a gathered tensor may have (gradcache's gather_input_tensor).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.complex64, torch.complex128)
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype`` (0 for a dtype not listed)."""
    return _DTYPE_CODES.get(dtype, 0)


_DEVICE_TYPES = ("cpu", "cuda")


def device_code(device: torch.device) -> float:
    """A number naming the features' device type (exchanged: every rank's must be the same)."""
    if device.type in _DEVICE_TYPES:
        return float(_DEVICE_TYPES.index(device.type))
    return float(zlib.crc32(device.type.encode()))


def _device_name(code: float) -> str:
    return repr(_DEVICE_TYPES[int(code)] if code < len(_DEVICE_TYPES) else f"device code {int(code)}")


def _dtype_name(code: float) -> str:
    dt = _CODE_DTYPES.get(int(code))
    return str(dt) if dt is not None else f"<unsupported dtype code {int(code)}>"


class Pending:
    """Outstanding transfers of one :meth:`Ring.shift`; ``wait()`` is idempotent.

    Keeps references to the sent and received tensors until completion so the
    caching allocator cannot recycle them while a transfer still reads or writes them.
    """

    def __init__(self, works: list, tensors: Sequence[Tensor], recv: List[Tensor]):
        self._works = works
        self._tensors = list(tensors)
        self.recv = recv

    def wait(self) -> List[Tensor]:
        """Block (gloo) or make the current CUDA stream wait (NCCL); return the received tensors."""
        for work in self._works:
            work.wait()
        self._works = []
        self._tensors = []
        return self.recv


@dataclass(frozen=True)
class Ring:
    """A process group arranged as a ring of its members in group-rank order."""

    group: object
    rank: int  # this process's rank within ``group``
    world: int  # number of members of ``group``
    next_peer: int  # GLOBAL rank of group rank (rank + 1) % world
    prev_peer: int  # GLOBAL rank of group rank (rank - 1) % world

    @staticmethod
    def of(group) -> "Ring":
        """The ring of ``group`` (a ``ProcessGroup``); ``ValueError`` if this process is not in it."""
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group was given but torch.distributed is not initialised (call init_process_group)")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given group "
                f"(members: global ranks {dist.get_process_group_ranks(group)}); call the loss only on members"
            )
        world = dist.get_world_size(group)
        nxt = dist.get_global_rank(group, (rank + 1) % world)
        prv = dist.get_global_rank(group, (rank - 1) % world)
        return Ring(group, rank, world, nxt, prv)

    def block_at(self, step: int) -> int:
        """Group rank whose block this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world

    def shift(self, send: Sequence[Tensor], recv: Sequence[Tensor]) -> Pending:
        """Post every ``send`` tensor to ``next`` and every ``recv`` buffer from ``prev``, as one batch.

        Doesn't wait. Messages between a pair of ranks match in posting order, so ``recv`` must
        be preallocated with the shapes/dtypes, in order, of what ``prev`` sends in its matching
        call; ``send`` and ``recv`` may differ in number (e.g. blocks of different sizes split
        into different numbers of chunks). On a ring of one, ``recv[i]`` becomes a copy of
        ``send[i]`` (equal numbers needed). NCCL needs CUDA tensors, gloo CPU tensors.
        """
        if self.world == 1 and len(send) != len(recv):
            raise ValueError(f"Ring.shift on a ring of one: {len(send)} tensors to send but {len(recv)} to receive")
        send = [t.contiguous() for t in send]
        recv = list(recv)
        if self.world == 1:  # as a real ring refuses other sizes: no broadcasting, no casting copy
            for i, (s, r) in enumerate(zip(send, recv)):
                if s.shape != r.shape or s.dtype != r.dtype:
                    raise ValueError(f"Ring.shift: recv[{i}] must have the shape and dtype of send[{i}] "
                                     f"({tuple(s.shape)}, {s.dtype}), got ({tuple(r.shape)}, {r.dtype})")
                r.copy_(s)
            return Pending([], [], recv)
        ops = [dist.P2POp(dist.isend, s, self.next_peer, self.group) for s in send]
        ops += [dist.P2POp(dist.irecv, r, self.prev_peer, self.group) for r in recv]
        works = dist.batch_isend_irecv(ops) if ops else []
        return Pending(works, send, recv)


def global_value(ring: "Ring", local: Tensor) -> Tensor:
    """``local`` (this rank's ``world_size`` x share of a global loss) with its VALUE replaced by the
    mean over ranks, the global loss, and its gradient unchanged (this rank's share, which DDP's
    averaging turns into the single-process gradient). Every rank then sees the same loss, and a NaN
    on any rank is a NaN on all (a finite-loss guard skips the backward on every rank alike).
    Cost: one scalar ``all_reduce``, no host sync."""
    if ring.world == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, group=ring.group)
    return _ValueOf.apply(local, total.div_(ring.world))


class _ValueOf(torch.autograd.Function):
    """``value``'s value with ``local``'s gradient (the identity backward). Unlike
    ``value + (local - local.detach())`` it keeps an infinite value (inf - inf would be NaN)."""

    @staticmethod
    def forward(ctx, local: Tensor, value: Tensor) -> Tensor:  # type: ignore[override]
        return value.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad, None


def offsets(sizes: Sequence[int]) -> List[int]:
    """Start of each shard in the global batch (rank order), plus the total at the end."""
    out = [0]
    for s in sizes:
        if int(s) < 0:
            raise ValueError(f"offsets: shard sizes must be >= 0, got {list(sizes)}")
        out.append(out[-1] + int(s))
    return out


def exchange_device(group, device: Optional[torch.device] = None) -> torch.device:
    """The device of the small metadata collectives on ``group``: chosen from the group alone, so
    that every rank exchanges on the same one whatever its features' device (a rank whose input is
    invalid, or not a tensor at all, must not land in gloo while the others wait in NCCL: a hang).

    gloo, and any group with a CPU backend (``init_process_group()`` without a backend on a GPU
    machine is ``cpu:gloo,cuda:nccl``): the CPU. NCCL alone: ``device`` when it is a CUDA device
    (the features', the rank's own GPU), else the current one. A group of another accelerator's
    backend only: likewise ``device`` when it is of that type, else its default."""
    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        return _on(device, "cuda")
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):  # older torch, or a custom group type
        config = ""
    types = [part.split(":")[0].strip() for part in config.split(",") if ":" in part]
    if not types or "cpu" in types:
        return torch.device("cpu")
    return _on(device, "cuda" if "cuda" in types else types[0])


def _on(device: Optional[torch.device], kind: str) -> torch.device:
    if device is not None and device.type == kind:
        return device
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def _group_problem(backend: str, device: torch.device, p2p: bool) -> Optional[str]:
    """A transport that cannot carry features on ``device``, reported as this rank's invalid input
    (raised on every rank) instead of failing inside the transport: gloo's send/recv (the ring,
    ``p2p``) take only CPU tensors, NCCL only CUDA tensors."""
    if backend == "gloo" and device.type != "cpu" and p2p:
        return (f"the features are on {device} but the process group's backend is gloo, whose send/recv "
                f"(the ring) moves only CPU tensors: use an NCCL group for CUDA features, CPU features, "
                f"or backend='reference' (gather, no send/recv)")
    if backend == "nccl" and device.type != "cuda":
        return (f"the features are on {device} but the process group's backend is nccl, which moves only "
                f"CUDA tensors: use a gloo group for CPU features (or CUDA features)")
    return None


# Every exchange sends this many float64 values per rank, whatever its fields: a fixed size, so
# that ranks calling different collectives (clip_loss on one, siglip_loss on another) meet in one
# all_gather of equal sizes and raise, instead of gloo aborting the process on a size mismatch.
_SLOTS = 32
# the layout code (which fields, in which order), the error flag, and the device type of the
# caller's tensors (in a mixed cpu:gloo,cuda:nccl group CPU and CUDA features of different ranks
# would meet in different transports)
_HEADER = 3


def _layout_code(names: Sequence[str]) -> float:
    return float(zlib.crc32(",".join(names).encode()))


def error_message(exc: BaseException) -> str:
    """How a rank's local exception is shared with the others (``agree``'s ``local_error``)."""
    return f"{type(exc).__name__}: {exc}"


def agree(
    ring: Ring,
    device: torch.device,
    fields: Mapping[str, float],
    *,
    same: Sequence[str] = (),
    local_error: Optional[str] = None,
    what: str = "loss",
    p2p: bool = False,
    shown: Optional[Mapping[str, Tuple[str, Callable[[float], str]]]] = None,
) -> Dict[str, List[float]]:
    """Exchange ``fields`` (numbers: sizes, D, dtype code, a scale...) among the ring's ranks.

    Returns ``{name: [value on group rank 0, 1, ...]}``. Raises the same ``ValueError``
    on every rank when any rank passed ``local_error`` (a message), when the ranks exchanged
    different fields (they called different functions), when their ``device`` types differ
    (the callers' tensors: CPU on one rank, CUDA on another), or when a field named in ``same``
    differs between ranks; ``shown`` gives a field's name and value format for that message
    (a field ``"dtype"`` is reported as a dtype name by default).
    Cost: one all_gather of ``_SLOTS`` float64 values per rank and one host sync;
    a second, object all_gather only on the error path (to show every rank's message).
    ``p2p``: the caller goes on to send/recv (the ring), which a gloo group does only with CPU tensors.
    """
    names, given = list(fields), device
    if len(names) > _SLOTS - _HEADER:
        raise AssertionError(f"agree() exchanges at most {_SLOTS - _HEADER} fields, got {len(names)}")
    if ring.world > 1:
        local_error = local_error or _group_problem(dist.get_backend(ring.group), device, p2p)
        device = exchange_device(ring.group, device)
    values = [_layout_code(names), 1.0 if local_error else 0.0, device_code(given)] + [float(fields[n]) for n in names]
    local = torch.tensor(values + [0.0] * (_SLOTS - len(values)), dtype=torch.float64, device=device)
    if ring.world == 1:
        rows = [local.tolist()]
    else:
        parts = [torch.empty_like(local) for _ in range(ring.world)]
        dist.all_gather(parts, local, group=ring.group)
        rows = torch.stack(parts).cpu().tolist()
    if any(row[0] != rows[0][0] for row in rows):
        calls = [None] * ring.world
        with cuda_device_current(device):  # an object collective packs on the current device
            dist.all_gather_object(calls, what, group=ring.group)
        raise ValueError("the ranks of the group called different collectives (every rank must make the same "
                         "call, in the same order): " + "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls)))
    table = {n: [row[_HEADER + i] for row in rows] for i, n in enumerate(names)}
    failed = [r for r, row in enumerate(rows) if row[1] != 0.0]
    if failed:
        if ring.world == 1:
            messages = [local_error]
        else:
            messages = [None] * ring.world
            with cuda_device_current(device):  # an object collective packs on the current device
                dist.all_gather_object(messages, local_error, group=ring.group)
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise ValueError(f"{what}: invalid input on group rank(s) {failed}: {detail}")
    if any(row[2] != rows[0][2] for row in rows):
        raise ValueError(f"{what}: the features' device type must be the same on every rank of the group, got "
                         f"[{', '.join(_device_name(row[2]) for row in rows)}] (by group rank)")
    display = {"dtype": ("the dtype", _dtype_name), **(shown or {})}
    for name in same:
        values = table[name]
        if any(not _same(v, values[0]) for v in values):
            label, fmt = display.get(name, (name, _fmt))
            raise ValueError(
                f"{what}: {label} must be the same on every rank of the group, got "
                f"[{', '.join(fmt(v) for v in values)}] (by group rank)"
            )
    return table


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)
