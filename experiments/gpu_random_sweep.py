"""Random-shape sweep of the GPU losses against the float64 full-matrix truth (one H200 visit).

Each case draws a loss (clip / infonce / siglip), a backend (triton, torch tiles), a dtype
(bf16 / fp16 / fp32), B (1..4096, and N >= B keys for InfoNCE), D (1..1100, odd included), a scale,
a bias, labels (InfoNCE indices, SigLIP class ids), and whether the features are non-contiguous
views; computes the loss and the gradients of every input (features, scale, bias) and compares
them with ``bigbatch.reference`` in float64 on the same (rounded) inputs. A case fails when a
norm-wise relative error exceeds the dtype's tolerance (output rounding of bf16/fp16 gradients,
TF32 products for fp32) or when it raises. Runs for ``--seconds`` and writes JSON.

    python experiments/gpu_random_sweep.py --seconds 150 --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback

import torch

import bigbatch
from bigbatch import reference

DEVICE = "cuda"
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-2}


def rel(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return (got - ref).norm().item() / max(ref.norm().item(), floor, 1e-30)


def draw(rng: random.Random) -> dict:
    loss = rng.choice(["clip", "infonce", "siglip"])
    b = rng.choice([1, 2, 3, 7, 16, 33, 127, 128, 129, 255, 511, 777, 1024, 1500, 2049, 4096])
    return {
        "loss": loss,
        "backend": rng.choice(["triton", "triton", "torch"]),
        "dtype": rng.choice(["bfloat16", "float16", "float32"]),
        "b": b,
        "n": b + (rng.choice([0, 1, 5, 100, 1000]) if loss == "infonce" else 0),
        "d": rng.choice([1, 2, 3, 8, 17, 31, 64, 100, 128, 255, 256, 512, 513, 768, 1000, 1100]),
        "scale": rng.choice([0.5, 1.0, 14.3, 50.0, 100.0]),
        "bias": rng.choice([-10.0, -3.0, 0.0]),
        "labels": rng.random() < 0.4,
        "noncontig": rng.random() < 0.3,
        "seed": rng.randrange(10**6),
    }


def features(rows: int, d: int, dtype: torch.dtype, noncontig: bool, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, d, generator=g, device=DEVICE)
    x = (x / x.norm(dim=1, keepdim=True).clamp_min(1e-6)).to(dtype)
    if noncontig:  # a transposed copy's transpose: same values, column-major strides
        x = x.t().contiguous().t()
    return x


def run_case(c: dict) -> dict:
    dtype = getattr(torch, c["dtype"])
    g = torch.Generator(device=DEVICE).manual_seed(c["seed"])
    q = features(c["b"], c["d"], dtype, c["noncontig"], g).requires_grad_()
    k = features(c["n"], c["d"], dtype, c["noncontig"], g).requires_grad_()
    scale = torch.tensor(c["scale"], device=DEVICE, requires_grad=True)
    bias = torch.tensor(c["bias"], device=DEVICE, requires_grad=True)
    labels = None
    if c["labels"] and c["loss"] == "infonce":
        labels = torch.randint(0, c["n"], (c["b"],), generator=g, device=DEVICE)
    if c["labels"] and c["loss"] == "siglip":
        labels = torch.randint(0, max(1, c["b"] // 2), (c["b"],), generator=g, device=DEVICE)
    leaves = [q, k, scale] + ([bias] if c["loss"] == "siglip" else [])

    def call(fn_mod, q, k, scale, bias, **kw):
        if c["loss"] == "clip":
            return fn_mod.clip_loss(q, k, scale, **kw)
        if c["loss"] == "infonce":
            return fn_mod.infonce_loss(q, k, scale, labels=labels, **kw) if fn_mod is bigbatch else \
                fn_mod.infonce_loss(q, k, scale, labels)
        return fn_mod.siglip_loss(q, k, scale, bias, labels=labels, **kw)

    loss = call(bigbatch, q, k, scale, bias, backend=c["backend"])
    grads = torch.autograd.grad(loss, leaves)
    r_leaves = [t.detach().double().requires_grad_() for t in leaves]
    r_bias = r_leaves[3] if c["loss"] == "siglip" else bias.detach().double()
    r_loss = call(reference, r_leaves[0], r_leaves[1], r_leaves[2], r_bias)
    r_grads = torch.autograd.grad(r_loss, r_leaves)
    # fp32 features on the softmax kernels multiply in TF32 by default (10-bit mantissa): a logit
    # then carries an absolute error up to ~1e-3 * scale, so a true loss of 0 (B = N = 1) comes out
    # as ~1e-4 * scale, and P_ii - 1 (true 0) as the forward/backward difference in summation order.
    tf32 = c["dtype"] == "float32" and c["backend"] == "triton" and c["loss"] != "siglip"
    errs = {"loss": rel(loss, r_loss, floor=max(1e-3, 0.1 * c["scale"] if tf32 else 0.0))}
    # Floors: near convergence (P_ii -> 1) the true gradient can be far below fp32's resolution of
    # the probabilities (~1e-7 absolute; ~1e-5 with TF32 products); a row's gradient is ~scale/B in
    # size, so an absolute error of 1e-4 (TF32: 1e-3) * scale/B per row is rounding, while a wrong
    # result is ~scale/B.
    for name, a, r in zip(["dq", "dk", "dscale", "dbias"], grads, r_grads):
        floor = 0.05 if a.dim() == 0 else (1e-3 if tf32 else 1e-4) * c["scale"] * a.shape[0] ** 0.5 / c["b"]
        errs[name] = rel(a, r, floor=floor)
    dtype_ok = all(a.dtype == t.dtype for a, t in zip(grads, leaves))
    tol = TOL[dtype]
    return {"errs": errs, "ok": dtype_ok and all(v <= tol for v in errs.values()), "tol": tol, "grad_dtypes_ok": dtype_ok}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="gpu_random_sweep.json")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the code (torch tiles only)")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    rng = random.Random(args.seed)
    cases, t0 = [], time.time()
    while time.time() - t0 < args.seconds:
        c = draw(rng)
        if DEVICE == "cpu":
            c.update(backend="torch", b=min(c["b"], 64), n=min(c["n"], 80 if c["loss"] == "infonce" else 64), d=min(c["d"], 40))
        try:
            c.update(run_case(c))
        except Exception as exc:  # a crash is a failure, recorded with its traceback
            c.update({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]})
        cases.append(c)
        if len(cases) % 50 == 0:
            print(f"{len(cases)} cases, {sum(not x['ok'] for x in cases)} outside tolerance so far", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    failed = [c for c in cases if not c["ok"]]
    worst = {}
    for c in cases:
        for name, v in c.get("errs", {}).items():
            key = f"{c['dtype']}/{name}"
            worst[key] = max(worst.get(key, 0.0), v)
    out = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "cases": len(cases),
           "failed": len(failed), "worst_rel_err": worst, "failures": failed[:50], "all": cases}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{len(cases)} cases, {len(failed)} failed; worst: {json.dumps(worst)}")
    for c in failed[:20]:
        print({k: c.get(k) for k in ("loss", "backend", "dtype", "b", "n", "d", "labels", "noncontig", "errs", "error")})
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
