"""Host time per LayerNorm call on the GPU machine: PyTorch's against the one-pass kernel's
``OnePassLayerNorm`` (``gradcache/norms.py``), forward and backward, and the pieces of the
latter's backward taken apart (session 22):

* ``fn_empty``: an autograd Function around ``F.layer_norm`` whose backward launches nothing
  (returns gradients made beforehand): what a Python backward node costs by itself;
* ``fn_native``: the same Function with PyTorch's own backward kernel (``native_layer_norm_backward``):
  a Python node plus PyTorch's launches;
* ``onepass_body``: the wall time spent inside ``LayerNormFunction.backward`` itself, per call;
* ``*_dy``: the same forward + backward given a contiguous incoming gradient (as in a model)
  instead of the ``.sum()``'s expanded one;
* ``launch_jit`` / ``launch_runner`` / ``launch_direct``: the Triton kernel alone launched through
  ``kernel[grid](...)`` (Triton's argument binding and specialisation per call), through the
  compiled kernel's own runner (``CompiledKernel[grid]``: the driver's launcher only), and through
  ``norm_kernel.launch`` (the runner behind the library's specialisation key);
* ``onepass_jit_fwd_bwd``: ``OnePassLayerNorm`` with ``norm_kernel.DIRECT`` off (every launch
  through the JIT);
* ``timeline`` (``--timeline``, session 23): per call, the host time between marks taken before the
  forward, at the Function's forward entry / exit, after the forward returns, before ``backward()``,
  at the Function's backward entry / exit and after ``backward()`` returns (medians of 2,000 calls),
  for PyTorch's norm, ``fn_empty``, ``fn_native`` and ``OnePassLayerNorm``: where the kernel path's
  extra host time sits, inside the Function or around it (the autograd engine's hand-offs).

Small rows (64 x 768, bf16 autocast), so that the GPU finishes each call long before the host
issues the next: the wall time per call is the host's. Medians of 5 runs of 2,000 calls.

    python experiments/gradcache_norm_host_probe.py --out /tmp/norm_host.json [--profile]
    py-spy record --threads -r 1000 -f raw -o /tmp/spin.txt -- \
        python experiments/gradcache_norm_host_probe.py --out /tmp/norm_host.json --spin 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from bigbatch.bench.common import hardware
from bigbatch.gradcache import norm_kernel, norms
from bigbatch.gradcache.norm_kernel import _launch_plan, _sms, layer_norm_backward, layer_norm_bwd_kernel


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


class EmptyBackward(torch.autograd.Function):
    """``F.layer_norm`` whose backward returns gradients made beforehand (no launch)."""
    grads = None

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, 1e-12)

    @staticmethod
    def backward(ctx, dy):
        ctx.saved_tensors
        return EmptyBackward.grads


class NativeBackward(torch.autograd.Function):
    """``native_layer_norm`` differentiated by PyTorch's own backward kernel, from Python."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, (x.shape[-1],), weight, bias, 1e-12)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        return torch.ops.aten.native_layer_norm_backward(dy, x, (x.shape[-1],), mean, rstd, weight, bias,
                                                        [True, True, True])


_MARKS: dict = {}


def mark(name: str) -> None:
    _MARKS.setdefault(name, []).append(time.perf_counter_ns())


def marked(fn, entry: str, exit: str):
    """``fn`` (a Function's forward or backward) with marks at its entry and exit."""
    def wrapped(ctx, *args):
        mark(entry)
        out = fn(ctx, *args)
        mark(exit)
        return out
    return staticmethod(wrapped)


TIMELINE = ("start", "fwd_in", "fwd_out", "fwd_done", "bwd_call", "bwd_in", "bwd_out", "bwd_done")


def timeline(fwd, grad_out, calls: int = 2000) -> dict:
    """Median host microseconds between consecutive marks of ``TIMELINE`` that were taken (a
    Function's inner marks only where the Function was wrapped with :func:`marked`)."""
    for _ in range(200):
        fwd().backward(grad_out)
    torch.cuda.synchronize()
    _MARKS.clear()
    for _ in range(calls):
        mark("start")
        y = fwd()
        mark("fwd_done")
        mark("bwd_call")
        y.backward(grad_out)
        mark("bwd_done")
    torch.cuda.synchronize()
    taken = [m for m in TIMELINE if len(_MARKS.get(m, ())) == calls]
    out = {}
    for a, b in zip(taken, taken[1:]):
        out[f"{a}->{b}"] = statistics.median((y - x) / 1e3 for x, y in zip(_MARKS[a], _MARKS[b]))
    out["total"] = statistics.median((y - x) / 1e3 for x, y in zip(_MARKS["start"], _MARKS["bwd_done"]))
    _MARKS.clear()
    return out


def profile_table(fn, calls: int = 300) -> str:
    """torch.profiler's table (self CPU time per op and per autograd node, all threads) of ``calls``
    calls of ``fn``, after a warm-up: where a call's host time goes, the backward's included."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--profile", action="store_true",
                   help="also profile 300 forward + backward calls of each (torch.profiler, CPU side, every "
                        "thread: the autograd engine's too) and keep its table of self CPU time per op")
    p.add_argument("--timeline", action="store_true", help="also time the pieces of each call (see above)")
    p.add_argument("--spin", type=float, default=0.0,
                   help="then loop OnePassLayerNorm's forward + backward this many seconds (for py-spy)")
    args = p.parse_args()
    dev = torch.device("cuda")
    ln = nn.LayerNorm(768).to(dev)
    x = torch.randn(64, 768, device=dev, requires_grad=True)
    amp = dict(device_type="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.autocast(**amp):
            return ln(x)

    def fwd_bwd():
        fwd().float().sum().backward()

    # a contiguous incoming gradient, as in a model (the .sum()'s is an expanded one: the kernel's
    # path copies it, PyTorch's backward reads it as it is)
    grad_out = torch.randn(64, 768, device=dev)

    def fwd_bwd_dy():
        fwd().backward(grad_out)

    res = {"hardware": hardware(), "shape": [64, 768]}
    res["pytorch_fwd_us"] = per_call_us(fwd)
    res["pytorch_fwd_bwd_us"] = per_call_us(fwd_bwd)
    res["pytorch_fwd_bwd_dy_us"] = per_call_us(fwd_bwd_dy)
    if args.profile:
        res["profile_pytorch"] = profile_table(fwd_bwd_dy)
    if args.timeline:
        res["timeline_pytorch"] = timeline(fwd, grad_out)
    EmptyBackward.grads = (torch.zeros_like(x), torch.zeros_like(ln.weight), torch.zeros_like(ln.bias))
    for name, fn in (("fn_empty", EmptyBackward), ("fn_native", NativeBackward)):
        def f(fn=fn):
            with torch.autocast(**amp):
                return fn.apply(x, ln.weight, ln.bias)
        res[f"{name}_fwd_us"] = per_call_us(f)
        res[f"{name}_fwd_bwd_us"] = per_call_us(lambda f=f: f().float().sum().backward())
        res[f"{name}_fwd_bwd_dy_us"] = per_call_us(lambda f=f: f().backward(grad_out))
        if args.timeline:
            with mock.patch.object(fn, "forward", marked(fn.forward, "fwd_in", "fwd_out")), \
                    mock.patch.object(fn, "backward", marked(fn.backward, "bwd_in", "bwd_out")):
                res[f"timeline_{name}"] = timeline(f, grad_out)
    saved = norms.ENABLED
    norms.ENABLED = True
    body = []
    original = norms.LayerNormFunction.backward

    def timed_backward(ctx, dy):
        t0 = time.perf_counter()
        out = original(ctx, dy)
        body.append(time.perf_counter() - t0)
        return out
    try:
        with norms.fast_layer_norms(norms.model_norms(ln)):
            assert type(ln) is norms.OnePassLayerNorm
            res["onepass_fwd_us"] = per_call_us(fwd)
            res["onepass_fwd_bwd_us"] = per_call_us(fwd_bwd)
            res["onepass_fwd_bwd_dy_us"] = per_call_us(fwd_bwd_dy)
            res["kernel_applies_us"] = per_call_us(lambda: norms.kernel_applies(ln, x))
            norm_kernel.DIRECT = False
            res["onepass_jit_fwd_bwd_us"] = per_call_us(fwd_bwd)
            norm_kernel.DIRECT = True
            norms.LayerNormFunction.backward = staticmethod(timed_backward)
            per_call_us(fwd_bwd)
            res["onepass_body_us"] = statistics.median(body) * 1e6
            body.clear()
            per_call_us(fwd_bwd_dy)
            res["onepass_body_dy_us"] = statistics.median(body) * 1e6
            if args.profile:
                res["profile_onepass"] = profile_table(fwd_bwd_dy)
            if args.timeline:
                fn = norms.LayerNormFunction
                with mock.patch.object(fn, "forward", marked(fn.forward, "fwd_in", "fwd_out")), \
                        mock.patch.object(fn, "backward", marked(original, "bwd_in", "bwd_out")):
                    res["timeline_onepass"] = timeline(fwd, grad_out)
    finally:
        norms.LayerNormFunction.backward = staticmethod(original)
        norms.ENABLED = saved
    xb = x.detach().to(torch.bfloat16)
    dy = torch.randn_like(xb)
    res["kernel_launch_us"] = per_call_us(lambda: layer_norm_backward(xb, dy, ln.weight, 1e-12, True, True, True))
    # the launch alone: outputs made beforehand
    m, n = xb.shape
    block_n, block_m, warps, programs, rows = _launch_plan(m, n, xb.element_size(), _sms(xb.get_device()))
    dx = torch.empty_like(xb)
    part = torch.empty((2, programs, n), device=dev, dtype=torch.float32)
    call = (xb, dy, ln.weight, dx, part, part[1], m, n, 1.0 / n, rows, 1e-12, xb.stride(0), dy.stride(0))
    consts = dict(HAS_W=True, NEED_DX=True, NEED_DW=True, NEED_DB=True, BLOCK_M=block_m, BLOCK_N=block_n)

    def jit():
        return layer_norm_bwd_kernel[(programs,)](*call, **consts, num_warps=warps)
    compiled = jit()
    res["launch_jit_us"] = per_call_us(jit)
    try:
        runner = compiled[(programs, 1, 1)]
        full = call + tuple(consts.values())
        try:
            runner(*full)
        except Exception:  # a Triton whose runner takes the non-constexpr arguments only
            full = call
            runner(*full)
        res["launch_runner_us"] = per_call_us(lambda: runner(*full))
    except Exception as exc:  # noqa: BLE001 -- a probe: record what this Triton did
        res["launch_runner_error"] = repr(exc)
    res["launch_direct_us"] = per_call_us(lambda: norm_kernel.launch(programs, call, consts, warps))
    res["empty_us"] = per_call_us(lambda: torch.empty(64, 768, device=dev))
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    if args.spin:
        norms.ENABLED = True
        with norms.fast_layer_norms(norms.model_norms(ln)):
            start = time.perf_counter()
            while time.perf_counter() - start < args.spin:
                fwd_bwd()


if __name__ == "__main__":
    main()
