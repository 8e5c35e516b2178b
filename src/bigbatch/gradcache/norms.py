"""LayerNorm with a one-pass backward (``norm_kernel.py``) for the chunks gradient caching back-propagates.
On by default where it runs (``ENABLED``, :func:`kernel_available`, below: NVIDIA GPUs of compute
capability 8.0 or later where Triton compiles and launches it, checked once per device).

At a 16 GiB budget the BERT-base benchmark's chunks are ~32k tokens, where PyTorch's LayerNorm
weight-gradient kernel runs far below memory bandwidth (docs/gradcache.md, "Where the rest goes").
:func:`fast_layer_norms` gives, for the duration of a ``with``, every plain ``nn.LayerNorm`` of the
given models (exact type, with a weight, on CUDA) the class :class:`OnePassLayerNorm`, whose
``forward`` computes the same output with ``F.layer_norm`` -- bitwise the module's own forward,
autocast included -- and differentiates it with :class:`LayerNormFunction`. Only the backward differs from PyTorch's: the same
formula, other rounding (fp32 sums in another order, mean and 1/std recomputed in fp32).

Saved for backward: ``x`` (in its own dtype), the weight and the bias -- no more than PyTorch
saves (``x`` or its autocast copy, mean, 1/std, weight, bias).
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._autograd import _compiling, batched, functorch_active, transformed
from . import walk

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PLAIN = (Tensor, nn.Parameter)  # a weight's types the kernel reads (a DTensor parameter is a DTensor)
# widest row the kernel takes (a row lives in registers: norm_kernel.py)
MAX_N = 8192


class LayerNormFunction(torch.autograd.Function):
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)`` with the one-pass Triton backward.
    ``normalized_shape`` may span several trailing dimensions; they are flattened into one row.
    A backward with ``create_graph=True`` (a model whose forward differentiates through the norm:
    forces from an energy) recomputes ``F.layer_norm`` and differentiates PyTorch's, so second
    derivatives are exact too."""

    @staticmethod
    def forward(ctx, x: Tensor, normalized_shape: Tuple[int, ...], weight: Optional[Tensor],
                bias: Optional[Tensor], eps: float) -> Tensor:
        out = F.layer_norm(x, normalized_shape, weight, bias, eps)  # autocast, if on, applies here as outside
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps
        ctx.shape = normalized_shape
        device = x.device.type
        ctx.amp = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, bias = ctx.saved_tensors
        # create_graph=True; is_grads_batched (a vmapped backward); an incoming gradient the kernel
        # cannot read (a tensor subclass, a nested tensor)
        if torch.is_grad_enabled() or type(dy) is not Tensor or dy.is_nested or batched(dy):
            return _differentiable_backward(ctx, dy, x, weight, bias)
        need_dx, _, need_dw, need_db, _ = ctx.needs_input_grad
        shape = ctx.shape
        n = shape[0] if len(shape) == 1 else math.prod(shape)
        dx, dw, db = _kernel().layer_norm_backward(
            x if x.dim() == 2 and x.shape[1] == n else x.reshape(-1, n),  # (a copy only for a non-viewable layout)
            dy if dy.dim() == 2 and dy.shape[1] == n else dy.reshape(-1, n),
            weight if weight is None or weight.dim() == 1 else weight.reshape(n), ctx.eps, need_dx, need_dw, need_db)
        if dx is not None and dx.shape != x.shape:
            dx = dx.view(x.shape)
        return dx, None, _param_grad(dw, weight, shape), _param_grad(db, bias, shape), None


def _bare_apply(fn_cls):
    """``fn_cls.apply`` without the Python prologue of ``torch.autograd.Function.apply``: binding
    default arguments (for Functions with a ``setup_context``: this one has none), the functorch
    query and unwrapping dead functorch wrappers (a pytree pass over the arguments). Called only
    where :func:`kernel_applies` holds -- no transform running, no argument wrapped by one -- where
    that prologue passes the arguments through unchanged: ~7 us less per LayerNorm call (a CPU
    here), in the re-run forwards that start host-bound after each model's own host sync. Plain
    ``apply`` on a torch without the C-level method."""
    raw = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")
    return raw.__get__(None, fn_cls) if hasattr(raw, "__get__") else fn_cls.apply


_APPLY = _bare_apply(LayerNormFunction)
_KERNEL = []


def _kernel():
    """``norm_kernel`` (imports Triton), imported at the first backward."""
    if not _KERNEL:
        from . import norm_kernel
        _KERNEL.append(norm_kernel)
    return _KERNEL[0]


def _differentiable_backward(ctx, dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]):
    """PyTorch's gradients: its layer norm recomputed on the saved tensors (under the forward's
    autocast setting) and differentiated -- as a graph under ``create_graph=True``; for a ``dy``
    the kernel cannot take (batched, a tensor subclass, nested) without one otherwise."""
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3])
    inputs = [t for t, k in zip((x, weight, bias), need) if k]
    device, dtype, amp = ctx.amp
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=amp):
        out = F.layer_norm(x, ctx.shape, weight, bias, ctx.eps)
    grads = iter(torch.autograd.grad(out, inputs, dy, create_graph=create_graph, allow_unused=True))
    dx, dw, db = (next(grads) if k else None for k in need)
    return dx, None, dw, db, None


def _param_grad(g: Optional[Tensor], param: Optional[Tensor], shape: Tuple[int, ...]) -> Optional[Tensor]:
    """A kernel's fp32 ``(N,)`` gradient in the shape and dtype of ``param``."""
    if g is None:
        return None
    if len(shape) > 1:
        g = g.view(shape)
    return g if g.dtype is param.dtype else g.to(param.dtype)


def on_kernel_device(t: Tensor) -> bool:
    """Where the kernel runs: CUDA. (The tests widen this to the CPU, under Triton's interpreter.)"""
    return t.is_cuda


def kernel_applies(module: nn.Module, x: Tensor) -> bool:
    """Whether a call of ``module`` (a plain ``nn.LayerNorm``) on ``x`` takes the kernel: a graph is
    recorded, a weight or bias requires grad, and ``x`` is a CUDA tensor of a dtype and row width
    the kernel takes (after autocast: fp16 / bf16 / fp32), no ``torch.func`` transform running
    (whatever its inputs) and no input carrying a forward-mode tangent (the Function has neither a vmap nor a jvp rule:
    PyTorch's layer norm has both), and not traced by ``torch.compile`` (a compiled function inside
    an uncompiled forward, which ``model_norms`` cannot see: the compiler fuses norms itself).
    Plain tensors only: a nested (jagged) input, a DTensor or another subclass -- whose backward
    would hand the kernel what it cannot read -- takes PyTorch's norm.
    (Runs per LayerNorm call: the cheapest tests first.)"""
    if not torch.is_grad_enabled() or type(x) is not Tensor or x.dtype not in _KERNEL_DTYPES \
            or not on_kernel_device(x) or x.is_nested:
        return False
    w, b = module.weight, module.bias
    return ((w is not None and w.requires_grad or b is not None and b.requires_grad)
            and (w is None or type(w) in _PLAIN and w.dtype in _KERNEL_DTYPES)
            and (b is None or type(b) in _PLAIN and b.dtype in _KERNEL_DTYPES)
            and math.prod(module.normalized_shape) <= MAX_N and not _compiling() and not functorch_active()
            and not transformed(x, w, b))


# fast_layer_norms contexts open now, in any thread (the autograd engine's device threads may run
# two GPUs' cached_encode re-runs at once: the count is changed under a lock)
_WINDOWS = [0]
_WINDOWS_LOCK = threading.Lock()


class OnePassLayerNorm(nn.LayerNorm):
    """The class a plain ``nn.LayerNorm`` takes inside :func:`fast_layer_norms`: the same module
    (``__dict__``, parameters, hooks), whose ``forward`` gives the same output and differentiates
    with the kernel where it applies. A class, not a ``forward`` set on the instance, so that copies
    made meanwhile -- ``nn.DataParallel``'s replicas, a ``deepcopy`` -- run it on their own weights;
    a copy that keeps the class takes the kernel only while a window is open."""

    def forward(self, x: Tensor) -> Tensor:
        if _WINDOWS[0] and kernel_applies(self, x):
            return _APPLY(x, tuple(self.normalized_shape), self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


# On by default (session 23; ``bigbatch.gradcache.norms.ENABLED = False`` gives PyTorch's norm
# everywhere). The kernel saves GPU time (~15-25 ms of a 2,048-row BERT step's ~775 on an H200);
# its Python autograd Function costs host time per LayerNorm call, which kept it opt-in through
# session 22 (2-7 ms slower at B = 512 and 1,024 on the benchmark's host). With the C-level apply
# (``_bare_apply``) it was faster at every B in session 23's interleaved A/B: 204.3 -> 199.0,
# 401.8 -> 393.0, 816.1 -> 798.2 ms at B = 512 / 1,024 / 2,048.
# experiments/gradcache_switch_ab.py, benchmarks/results/probes/norms_ab_s22_*.json, norms_ab_s23_*.json.
ENABLED = True

# per device: whether the kernel runs there (decided once per process, :func:`kernel_available`)
_AVAILABLE: Dict[Tuple[str, int], bool] = {}
_AVAILABLE_LOCK = threading.Lock()
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)


def kernel_available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``, decided once per device and process: an NVIDIA build
    of torch (on ROCm the kernel is untested: PyTorch's norm, quietly), a GPU of compute capability
    8.0 or later (what Triton supports: on older GPUs its bf16 conversions may not compile), and the
    kernel compiled, launched (through Triton's JIT, then directly) and checked against float64 on
    a small input there (:func:`_self_test`): Triton may import and still fail at its first launch
    (no C compiler to build its launcher, as in slim images). Where it cannot run, a warning says
    why and the norms keep PyTorch's backward. Asked where the self-test could not speak for the
    device -- inside a ``torch.func`` transform, a Python dispatch mode (``FakeTensorMode``) or a
    CUDA graph capture -- the answer is no for that call, and the question stays open."""
    if torch.version.hip is not None:
        return False
    index = device.index
    if index is None:  # (the current GPU; -1 off CUDA)
        index = torch.cuda.current_device() if device.type == "cuda" else -1
    key = (device.type, index)
    if key in _AVAILABLE:
        return _AVAILABLE[key]
    if _deferred():
        return False
    with _AVAILABLE_LOCK:  # (two threads asking at once: one self-test)
        if key not in _AVAILABLE:
            why = _self_test(torch.device(device.type, index) if device.type == "cuda" else device)
            _AVAILABLE[key] = why is None  # (before the warning: a warnings filter may raise it)
            if why is not None:
                warnings.warn(f"bigbatch: the one-pass LayerNorm backward cannot run on {device} ({why}); gradient "
                              f"caching uses PyTorch's LayerNorm backward there", RuntimeWarning, stacklevel=3)
    return _AVAILABLE[key]


def _deferred() -> bool:
    """A context in which a self-test would fail for reasons of its own: a ``torch.func`` transform
    running, a Python dispatch mode (fake tensors, tracing) active, a CUDA graph being captured."""
    return (functorch_active() or (_DISPATCH_MODES is not None and _DISPATCH_MODES() > 0)
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()))


def _self_test(device: torch.device) -> Optional[str]:
    """``None`` if the kernel runs on ``device`` -- launched twice: through Triton's JIT, then its
    compiled runner (``norm_kernel.launch``) -- and its three gradients of a 37 x 24 fp32 layer norm
    match float64's closed form; else why not. Touches no random state (its data come from a
    generator of its own) and runs no autograd (no hook of the caller's sees it); the same in
    inference mode, without grad, under autocast or another default device."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is not None and capability < (8, 0):
        return f"compute capability {capability}, below 8.0"
    try:
        with torch.inference_mode(False), torch.no_grad():
            g = torch.Generator().manual_seed(0)  # (device="cpu" below: whatever the default device)
            x, dy = (torch.randn(37, 24, generator=g, dtype=torch.float64, device="cpu") for _ in range(2))
            w = torch.randn(24, generator=g, dtype=torch.float64, device="cpu")
            want = _reference_grads(x, dy, w, 1e-5)
            on = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
            for _ in range(2):
                with on:  # (Triton launches on the current device)
                    got = _kernel().layer_norm_backward(x.float().to(device), dy.float().to(device),
                                                        w.float().to(device), 1e-5, True, True, True)
                if not all(torch.allclose(a.double().cpu(), r, rtol=1e-4, atol=1e-5) for a, r in zip(got, want)):
                    return "its gradients of a test input differ from float64's"
    except Exception as exc:  # noqa: BLE001 -- any failure to compile or launch: the norm is not swapped
        return f"{type(exc).__name__}: {exc}"
    return None


def _reference_grads(x: Tensor, dy: Tensor, w: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    """LayerNorm's gradients over the last dimension of ``x`` (dx, dw, db), in closed form."""
    n = x.shape[-1]
    mean = x.mean(-1, keepdim=True)
    rstd = ((x - mean).square().mean(-1, keepdim=True) + eps).rsqrt()
    xhat = (x - mean) * rstd
    wdy = dy * w
    dx = rstd * (wdy - wdy.sum(-1, keepdim=True) / n - xhat * (wdy * xhat).sum(-1, keepdim=True) / n)
    return dx, (dy * xhat).sum(0), dy.sum(0)


def model_norms(model: nn.Module) -> List[nn.LayerNorm]:
    """The modules of ``model`` that :func:`fast_layer_norms` is to swap: plain ``nn.LayerNorm``
    (exact type: a subclass may override ``forward``; a parametrized one is a subclass) with a CUDA
    weight (a plain tensor: not a DTensor or other subclass) on a device where the kernel runs
    (:func:`kernel_available`), whose ``forward`` is not set on the instance already (accelerate's
    device hooks do). None in a model with a ``torch.compile``'d part (the compiled graph has fused
    norms of its own)."""
    from .engine import has_compiled_part

    if not ENABLED or not isinstance(model, nn.Module):
        return []
    if has_compiled_part(model):
        return []
    return [m for m in walk.submodules(model) if type(m) is nn.LayerNorm and type(m.weight) in _PLAIN
            and on_kernel_device(m.weight) and "forward" not in m.__dict__ and kernel_available(m.weight.device)]


@contextlib.contextmanager
def fast_layer_norms(norms: Sequence[nn.LayerNorm]) -> Iterator[None]:
    """Within the ``with``, ``norms`` (from :func:`model_norms`) are :class:`OnePassLayerNorm`: around
    every forward *and backward* of a chunk with a graph (activation checkpointing re-runs the
    forward inside the backward, and must save what the first forward saved). Nested: a norm
    swapped already is left to the outer ``with``."""
    swapped = []
    with _WINDOWS_LOCK:
        _WINDOWS[0] += 1
    try:
        for m in norms:
            if type(m) is nn.LayerNorm and "forward" not in m.__dict__:
                m.__class__ = OnePassLayerNorm
                swapped.append(m)
        yield
    finally:
        with _WINDOWS_LOCK:
            _WINDOWS[0] -= 1
        for m in swapped:
            if type(m) is OnePassLayerNorm:
                m.__class__ = nn.LayerNorm
