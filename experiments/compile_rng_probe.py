"""Does a torch.compile'd encoder replay its dropout masks from a restored CUDA generator state?

For a small BertModel (attention dropout and hidden dropout switched on separately), eager and
compiled: the representation of a no-grad forward, the same forward again from the same generator
state, and a grad-mode forward from that state (what GradCache's pass 1 and re-run do), with the
generator offset each consumed. Writes JSON to argv[1] (default stdout)."""

import json
import sys

import torch
from transformers import BertConfig, BertModel

out = {"torch": torch.__version__}
dev = "cuda" if torch.cuda.is_available() else "cpu"
for attn_p, hid_p, impl in ((0.1, 0.0, "sdpa"), (0.0, 0.1, "sdpa"), (0.1, 0.1, "sdpa"), (0.1, 0.0, "eager")):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                     attention_probs_dropout_prob=attn_p, hidden_dropout_prob=hid_p)
    cfg._attn_implementation = impl
    m = BertModel(cfg).to(dev).train()
    ids = torch.randint(1000, 3000, (24, 40), device=dev)
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    for name, f in (("eager", m), ("compiled", torch.compile(m, dynamic=True))):
        res = {}
        for rep in range(2):  # the second round runs after every graph exists
            torch.manual_seed(7)
            s = torch.cuda.get_rng_state()
            o0 = torch.cuda.default_generators[0].get_offset()
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                a = f(**x).last_hidden_state.float()
            o1 = torch.cuda.default_generators[0].get_offset()
            torch.cuda.set_rng_state(s)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                b = f(**x).last_hidden_state.float()
            torch.cuda.set_rng_state(s)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                c = f(**x).last_hidden_state.float()
            o2 = torch.cuda.default_generators[0].get_offset()
            c.sum().backward()
            torch.cuda.set_rng_state(s)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                d = f(**x).last_hidden_state.float()
            res[f"round{rep}"] = {
                "nograd_vs_nograd": (a - b).abs().max().item(), "nograd_vs_grad": (a - c).abs().max().item(),
                "grad_vs_grad": (c - d).abs().max().item(), "offset_nograd": o1 - o0,
                "offset_grad": o2 - o0, "scale": a.abs().max().item(),
            }
        out[f"attn{attn_p}_hidden{hid_p}_{impl}_{name}"] = res
        print(name, attn_p, hid_p, impl, res, flush=True)
text = json.dumps(out, indent=1)
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(text)
