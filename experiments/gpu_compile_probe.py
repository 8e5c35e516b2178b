"""Which losses compile as one graph on CUDA with the Triton kernels, and does a compile with graph
breaks give eager's loss and gradients? Writes JSON (one row per loss x backend x fullgraph).

    python experiments/gpu_compile_probe.py --out compile.json
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

import bigbatch


def step_for(loss_name: str, backend: str):
    def step(q, k, s):
        if loss_name == "siglip":
            return bigbatch.siglip_loss(q, k, s.exp(), -1.0, backend=backend)
        return getattr(bigbatch, f"{loss_name}_loss")(q, k, s.exp(), backend=backend)
    return step


def run(fn, q0, k0):
    q, s = q0.clone().requires_grad_(), torch.tensor(2.0, device=q0.device, requires_grad=True)
    loss = fn(q, k0, s)
    loss.backward()
    return [loss.detach(), q.grad, s.grad]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_compile_probe.json")
    args = p.parse_args()
    torch.manual_seed(0)
    q0 = torch.nn.functional.normalize(torch.randn(300, 64, device="cuda"), dim=1)
    k0 = torch.nn.functional.normalize(torch.randn(300, 64, device="cuda"), dim=1)
    rows = []
    for loss_name in ("clip", "infonce", "siglip"):
        for backend in ("triton", "torch"):
            eager = run(step_for(loss_name, backend), q0, k0)
            for fullgraph in (True, False):
                torch._dynamo.reset()
                row = {"loss": loss_name, "backend": backend, "fullgraph": fullgraph}
                try:
                    got = run(torch.compile(step_for(loss_name, backend), backend="aot_eager", fullgraph=fullgraph), q0, k0)
                    row["max_rel_err"] = max(float((a - b).norm() / b.norm()) for a, b in zip(got, eager))
                    row["ok"] = True
                except Exception as exc:  # the reason is the point of this probe
                    text = "".join(traceback.format_exception_only(type(exc), exc))
                    row["ok"] = False
                    row["error"] = text[:3000]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "error"}), (row.get("error") or "")[:300])
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
