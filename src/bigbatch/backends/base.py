"""The small interface every tile backend implements.

A backend computes, for one block of queries ``q`` (B x D) against one block of
keys ``k`` (N x D) with logits ``S = s * q @ k.T``, the two quantities every
softmax loss in bigbatch is built from:

* ``lse``: the row log-sum-exp ``log sum_j exp(S_ij)`` (B floats) and/or the
  column log-sum-exp ``log sum_i exp(S_ij)`` (N floats), from ONE pass over the
  tiles of S. Partial results over different key (or query) blocks merge with
  ``torch.logaddexp``, which is what the ring across ranks does.
* ``lse_grad``: given the (global) statistics and the incoming gradients
  ``g_row`` (B) / ``g_col`` (N) of the log-sum-exps, with
  ``dS_ij = g_row_i * exp(S_ij - lse_row_i) + g_col_j * exp(S_ij - lse_col_j)``
  (the gradient of ``sum_i g_row_i lse_row_i + sum_j g_col_j lse_col_j`` w.r.t. S):
  ``dq = s * dS @ k``, ``dk = s * dS.T @ q`` and
  ``d_scale = sum_ij dS_ij (q k^T)_ij`` (which equals ``sum_i q_i . (dS @ k)_i``).

The positive logits ``S_{i, y_i}`` are O(B*D) and computed by the caller, but their
gradient enters ``lse_grad`` (``pos_labels``, ``g_pos``): it is added to dS in the
compute dtype *before* the products, because near convergence ``P_ii -> 1`` and the
LSE and positive terms cancel; rounding each to a half dtype first would lose the
difference. A backend knows nothing of ranks or reductions.

Conventions shared by all backends:
* ``scale`` is a 0-d tensor in the compute dtype on the features' device (no
  host synchronisation is needed to read it).
* Statistics are returned in the compute dtype: float32 for float16/bfloat16/
  float32 inputs, float64 for float64 inputs; accumulation is in that dtype too.
* No B x N tensor is ever allocated; workspace is bounded by the tile size.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Optional, Protocol, Tuple, TypeVar, runtime_checkable

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable[..., Any])


def cuda_device_current(device: torch.device) -> ContextManager[Any]:
    """``device`` made the current CUDA device for the block (nothing for a CPU device). Triton
    launches kernels, and torch packs an object collective's bytes, on the *current* device: work
    for tensors on another GPU must run under this."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def on_inputs_device(method: F) -> F:
    """Run a backend method with its first tensor argument's CUDA device current. Triton launches a
    kernel on the *current* device and its current stream: for features on cuda:1 in a process
    left on cuda:0 (a model moved there, the last layer of a model split over GPUs) it would fail
    ("cannot be accessed from Triton") or, with peer access, run on cuda:0's stream, unordered
    against cuda:1's work on the same buffers."""

    @functools.wraps(method)
    def run(self: Any, q: Tensor, *args: Any, **kwargs: Any) -> Any:
        with cuda_device_current(q.device):
            return method(self, q, *args, **kwargs)

    return run  # type: ignore[return-value]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for features of ``dtype``: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@runtime_checkable
class TileBackend(Protocol):
    """What the autograd Functions and the ring need from a backend."""

    name: str

    def supports(self, device: torch.device) -> bool:
        """Whether this backend can run on ``device``."""
        ...

    def lse(
        self, q: Tensor, k: Tensor, scale: Tensor, *, rows: bool, cols: bool
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """Row LSE (B,) if ``rows`` and column LSE (N,) if ``cols`` of ``scale * q @ k.T``."""
        ...

    def lse_grad(
        self,
        q: Tensor,
        k: Tensor,
        scale: Tensor,
        lse_row: Optional[Tensor],
        lse_col: Optional[Tensor],
        g_row: Optional[Tensor],
        g_col: Optional[Tensor],
        *,
        pos_labels: Optional[Tensor] = None,
        g_pos: Optional[Tensor] = None,
        grad_dtype: Optional[torch.dtype] = None,
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, d_scale)``.

        With ``pos_labels`` (B,) int64 and ``g_pos`` (B,): ``dS[i, pos_labels[i]] += g_pos[i]``
        (the gradient of ``sum_i g_pos_i S_{i, pos_labels_i}``); a label outside ``[0, N)`` (e.g. the
        global index of a key in another block, minus this block's start) means row i has no
        positive among these keys.

        ``dq``/``dk`` are in ``grad_dtype`` (default: the inputs' dtype; the ring asks for the
        compute dtype to accumulate partials over key blocks); ``d_scale`` is a 0-d tensor in the
        compute dtype. A direction whose ``lse`` or ``g`` is ``None`` contributes nothing.
        """
        ...


@runtime_checkable
class SigmoidBackend(Protocol):
    """What the sigmoid (SigLIP) loss and its ring need from a backend.

    For a block of queries ``q`` (M x D) and keys ``k`` (N x D), with logits
    ``u = scale * q @ k.T + bias`` and signs ``z = +1`` on positive pairs, ``-1`` elsewhere,
    one pass over the tiles gives the summed loss ``sum_ij softplus(-z_ij u_ij)`` and its
    gradient w.r.t. the logits ``G = sigmoid(u) - [z = +1]`` (no global statistic is needed).
    Positives: ``q_ids[i] == k_ids[j]`` when ids are given, else ``j == i + diagonal``
    (``diagonal=None``: the block has no positives).
    """

    name: str

    def supports(self, device: torch.device) -> bool:
        """Whether this backend can run on ``device``."""
        ...

    def sigmoid_pass(
        self,
        q: Tensor,
        k: Tensor,
        scale: Tensor,
        bias: Tensor,
        *,
        q_ids: Optional[Tensor] = None,
        k_ids: Optional[Tensor] = None,
        diagonal: Optional[int] = 0,
        dq_acc: Optional[Tensor] = None,
        dk_acc: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor]:
        """``(loss_sum, g_sum)``: 0-d tensors in the compute dtype, ``sum_ij softplus(-z u)`` and
        ``sum_ij G_ij`` (the bias gradient of ``loss_sum``).

        When given, ``dq_acc`` (M x D) and ``dk_acc`` (N x D), compute-dtype accumulators, receive
        ``+= G @ k`` and ``+= G.T @ q`` (unscaled: the caller multiplies by ``scale``; the scale
        gradient is ``sum_i q_i . dq_acc_i``, an O(M*D) dot product).
        """
        ...
