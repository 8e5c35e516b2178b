"""Do a compiled encoder's bf16 outputs depend on how autocast regions are opened around its
chunks? Tiny BERT, torch.compile(dynamic=True), chunks of 8 of a 20-row batch, one seed per run:
(a) each chunk in its own autocast region, (b) all chunks in one region, (c) (b) in grad mode
with the graph dropped (GradCache's pass 1 of a compiled model), (d) the same for the eager
model. Prints and writes max |difference| between the variants' representations (0 = bitwise)."""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import BertConfig, BertModel


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=40)
    eager = BertModel(cfg).train().to(dev)
    compiled = torch.compile(eager, dynamic=True)
    g = torch.Generator().manual_seed(3)
    x = {"input_ids": torch.randint(1, 97, (20, 16), generator=g).to(dev),
         "attention_mask": torch.ones(20, 16, dtype=torch.long, device=dev)}
    chunks = [{k: v[i:i + 8] for k, v in x.items()} for i in range(0, 20, 8)]

    def run(model, regions: str, grad: bool):
        torch.manual_seed(5)
        out = []
        with torch.set_grad_enabled(grad):
            if regions == "one":
                with torch.autocast(dev, dtype=torch.bfloat16):
                    out = [model(**c).last_hidden_state[:, 0].detach() for c in chunks]
            else:
                for c in chunks:
                    with torch.autocast(dev, dtype=torch.bfloat16):
                        out.append(model(**c).last_hidden_state[:, 0].detach())
        return torch.cat(out).float()

    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}
    for name, model in (("compiled", compiled), ("eager", eager)):
        runs = {f"{r}_{'grad' if gr else 'nograd'}": run(model, r, gr) for r in ("per_chunk", "one") for gr in (True, False)}
        runs["per_chunk_grad_again"] = run(model, "per_chunk", True)
        base = runs["per_chunk_grad"]
        result[name] = {k: (v - base).abs().max().item() for k, v in runs.items()}
    print(json.dumps(result, indent=1))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "compile_autocast_region_probe.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
