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
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Pending", "Ring", "agree", "dtype_code", "global_value", "offsets"]

# Stable small integers for the dtypes a feature tensor may have (exchanged as metadata).
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype`` (0 for dtypes features may not have)."""
    return _DTYPE_CODES.get(dtype, 0)


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
        if self.world == 1:
            for s, r in zip(send, recv):
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
        out.append(out[-1] + int(s))
    return out


def _group_device(backend: str, device: torch.device, p2p: bool):
    """(problem or None, device for the metadata exchange) for features on ``device`` and a group
    of ``backend``. gloo's send/recv (the ring, ``p2p``) take only CPU tensors, NCCL only CUDA
    tensors: a mismatch is reported as a local error (raised on every rank) instead of failing
    inside the transport. gloo's metadata exchange always runs on the CPU (any feature device)."""
    if backend == "gloo":
        if device.type != "cpu" and p2p:
            return (f"the features are on {device} but the process group's backend is gloo, whose send/recv "
                    f"(the ring) moves only CPU tensors: use an NCCL group for CUDA features, CPU features, "
                    f"or backend='reference' (gather, no send/recv)"), torch.device("cpu")
        return None, torch.device("cpu")
    if backend == "nccl" and device.type != "cuda":
        return (f"the features are on {device} but the process group's backend is nccl, which moves only "
                f"CUDA tensors: use a gloo group for CPU features (or CUDA features)"), \
            torch.device("cuda")  # the current device
    return None, device


def agree(
    ring: Ring,
    device: torch.device,
    fields: Mapping[str, float],
    *,
    same: Sequence[str] = (),
    local_error: Optional[str] = None,
    what: str = "loss",
    p2p: bool = False,
) -> Dict[str, List[float]]:
    """Exchange ``fields`` (numbers: sizes, D, dtype code, a scale...) among the ring's ranks.

    Returns ``{name: [value on group rank 0, 1, ...]}``. Raises the same ``ValueError``
    on every rank when any rank passed ``local_error`` (a message) or when a field named
    in ``same`` differs between ranks (a field ``"dtype"`` is reported as a dtype name).
    Cost: one all_gather of ``len(fields) + 1`` float64 values per rank and one host sync;
    a second, object all_gather only on the error path (to show every rank's message).
    All ranks of the group must call this with the same field names, in the same order.
    ``p2p``: the caller goes on to send/recv (the ring), which a gloo group does only with CPU tensors.
    """
    names = list(fields)
    if ring.world > 1:
        problem, device = _group_device(dist.get_backend(ring.group), device, p2p)
        local_error = local_error or problem
    local = torch.tensor(
        [float(fields[n]) for n in names] + [1.0 if local_error else 0.0], dtype=torch.float64, device=device
    )
    if ring.world == 1:
        rows = [local.tolist()]
    else:
        parts = [torch.empty_like(local) for _ in range(ring.world)]
        dist.all_gather(parts, local, group=ring.group)
        rows = torch.stack(parts).cpu().tolist()
    table = {n: [row[i] for row in rows] for i, n in enumerate(names)}
    failed = [r for r, row in enumerate(rows) if row[-1] != 0.0]
    if failed:
        if ring.world == 1:
            messages = [local_error]
        else:
            messages = [None] * ring.world
            dist.all_gather_object(messages, local_error, group=ring.group)
        detail = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise ValueError(f"{what}: invalid input on group rank(s) {failed}: {detail}")
    for name in same:
        values = table[name]
        if any(not _same(v, values[0]) for v in values):
            shown = [_dtype_name(v) for v in values] if name == "dtype" else [_fmt(v) for v in values]
            raise ValueError(
                f"{what}: {name} must be the same on every rank of the group, got [{', '.join(shown)}] "
                f"(by group rank)"
            )
    return table


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)
