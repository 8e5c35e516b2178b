"""Where does a GradCache step on a tiny budget go over it? The GPU test's model (six 1024-wide
Linear + Tanh layers, 24 MiB of weights), 2048 rows per input, budget = allocated + 100 MiB:
the step's peak with the CLIP loss (its tile workspace is not in the plan, only 5% slack) and with
a loss of no workspace ((a * b).sum()), each planned by the same prober. Writes JSON to $OUT."""

from __future__ import annotations

import json
import os

import torch

import bigbatch
from bigbatch.gradcache import GradCache


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    d = 1024
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()) for _ in range(6)]).to(dev)
    x, y = torch.randn(2048, d, device=dev), torch.randn(2048, d, device=dev)
    model(x[:64]).sum().backward()
    losses = {"clip": lambda a, b: bigbatch.clip_loss(a, b, 5.0), "dot": lambda a, b: (a * b).sum() * 1e-3}
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, loss in losses.items():
        for keep in (True, False):
            gc = GradCache(model, loss_fn=loss, memory_budget=1, keep_last_graph=keep)  # budget set below
            for _ in range(2):
                for p in model.parameters():
                    p.grad = None
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                gc.memory_budget = base + 100 * 2**20
                torch.cuda.reset_peak_memory_stats()
                gc(x, y)
                torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            out[f"{name}_keep{keep}"] = {"peak_mib": peak / 2**20, "chunks": gc.last_chunk_rows, "kept": gc.last_kept_rows}
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gradcache_loss_workspace_probe.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
