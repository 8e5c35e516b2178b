"""Accuracy of the one-pass LayerNorm backward in a real step: the benchmark's BERT-base dual
encoder (``bigbatch.bench.gradcache``, random weights), dropout off (eval mode: the masks of fp32
and bf16 tensors would differ), B = 64 in chunks of 16, every gradient of a GradCache step
against the same step in float64, for fp32 and bf16 autocast with the kernel on and off
(``norms.ENABLED``). Two losses: the benchmark's (raw [CLS] states, learned scale e^2: a very
sharp softmax, loss ~270) and the same on L2-normalised features.

    python experiments/gradcache_norm_accuracy.py --out /tmp/norm_accuracy.json
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import torch.nn.functional as F

import bigbatch
from bigbatch.bench.common import hardware
from bigbatch.bench.gradcache import DualEncoder, _inputs, _rep
from bigbatch.gradcache import GradCache, norms

from gradcache_fused_ab import switch_set  # (an experiment next to this one)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    args = ap.parse_args()
    device = torch.device("cuda")
    setup = DualEncoder(device)
    setup.mq.eval()
    setup.mp.eval()
    qi = _inputs(args.batch, 32, setup.cfg.vocab_size, device, 1)
    pi = _inputs(args.batch, 128, setup.cfg.vocab_size, device, 2)
    out = {"experiment": "gradcache_norm_accuracy", "hardware": hardware(), "args": vars(args), "rows": []}

    def step(mq, mp, scale, amp, sharp: bool):
        params = list(mq.parameters()) + list(mp.parameters()) + [scale]
        for t in params:
            t.grad = None

        def loss_fn(q, k):
            q, k = q.to(scale.dtype), k.to(scale.dtype)
            if not sharp:
                q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            return bigbatch.clip_loss(q, k, scale.exp(), backend="torch")

        loss = GradCache([mq, mp], args.chunk, loss_fn, get_rep_fn=_rep, autocast_dtype=amp)(qi, pi)
        return torch.cat([t.grad.double().flatten() for t in params if t.grad is not None]).cpu(), loss.item()

    m64 = [copy.deepcopy(setup.mq).double(), copy.deepcopy(setup.mp).double()]
    s64 = torch.nn.Parameter(setup.logit_scale.detach().double().clone())
    for sharp in (True, False):
        ref, ref_loss = step(*m64, s64, None, sharp)
        row = {"loss": "benchmark (raw features)" if sharp else "normalised features", "loss_fp64": ref_loss}
        for amp in (None, torch.bfloat16):
            for on in (False, True):
                with switch_set(norms, on):
                    g, l = step(setup.mq, setup.mp, setup.logit_scale, amp, sharp)
                key = f"{'fp32' if amp is None else 'bf16'}_{'kernel' if on else 'pytorch'}"
                row[key] = {"grad_rel_err_vs_fp64": ((g - ref).norm() / ref.norm()).item(), "loss": l}
                row.setdefault("_g", {})[key] = g
        gs = row.pop("_g")
        for p in ("fp32", "bf16"):
            a, b = gs[f"{p}_kernel"], gs[f"{p}_pytorch"]
            row[f"{p}_kernel_vs_pytorch"] = ((a - b).norm() / b.norm()).item()
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
