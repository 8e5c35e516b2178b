"""Gradient caching with ``torch.compile``'d encoders (CPU, inductor).

A compiled module runs one graph with grad and another without: the no-grad (inference) graph
fuses differently, so its outputs differ from the training graph's in the last bits under bf16
autocast. Pass 1 of a compiled model therefore runs in grad mode (its graph dropped at once), so
that the representations the loss sees are bitwise the ones the re-run back-propagates through,
as in eager mode. Before, a tiny BERT was 1.4e-5 off the full batch's gradient here and the
benchmark's BERT-base check on an H200 3.4% (a sharp loss amplifies the last bits).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch.gradcache import GradCache, cached_encode
from bigbatch.gradcache.chunking import split_batch
from bigbatch.gradcache.engine import grad_mode_dependent

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def _cls(out):
    return out.last_hidden_state[:, 0]


def _tiny_bert(seed: int) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=40)
    return BertModel(cfg).train()


def _batch(b: int, seq: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (b, seq), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones(b, seq, dtype=torch.long, device=device)}


def _loss(a, b):
    return bigbatch.clip_loss(a.float(), b.float(), 10.0, backend="torch")


def _grads(params):
    return torch.cat([p.grad.flatten() for p in params])


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # CUDA: inductor's Triton kernels, CUDA dropout


@pytest.fixture(scope="module", params=DEVICES)
def compiled(request):
    mq, mp = _tiny_bert(0).to(request.param), _tiny_bert(1).to(request.param)
    return mq, mp, torch.compile(mq, dynamic=True), torch.compile(mp, dynamic=True)


def test_compiled_modules_are_detected():
    plain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert not grad_mode_dependent(plain)
    assert grad_mode_dependent(torch.compile(plain))
    part = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    part[1].compile()  # in place, on a submodule
    assert grad_mode_dependent(part)
    assert grad_mode_dependent(nn.Sequential(torch.compile(nn.Linear(2, 2))))


@pytest.mark.parametrize("api", ["GradCache", "cached_encode"])
def test_compiled_bert_bf16_matches_the_full_batch(compiled, api):
    mq, mp, cq, cp = compiled
    dev = next(mq.parameters()).device.type
    params = list(mq.parameters()) + list(mp.parameters())
    q, p = _batch(12, 8, 2, dev), _batch(12, 16, 3, dev)
    for t in params:
        t.grad = None
    torch.manual_seed(5)  # reference: the same chunks (dropout masks), one graph, compiled as well
    with torch.autocast(dev, dtype=torch.bfloat16):
        ref_loss = _loss(torch.cat([_cls(cq(**c)) for c in split_batch(q, 8)]),
                         torch.cat([_cls(cp(**c)) for c in split_batch(p, 8)]))
    ref_loss.backward()
    ref = _grads(params)
    for t in params:
        t.grad = None
    torch.manual_seed(5)
    if api == "GradCache":
        loss = GradCache([cq, cp], chunk_sizes=8, loss_fn=_loss, get_rep_fn=_cls, autocast_dtype=torch.bfloat16)(q, p)
    else:
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = _loss(cached_encode(cq, q, 8, get_rep_fn=_cls), cached_encode(cp, p, 8, get_rep_fn=_cls))
        loss.backward()
    # the same representations bit for bit; the gradients up to float32 accumulation order
    # (the reference adds the chunks' gradients in one backward, gradient caching chunk by chunk)
    assert loss.item() == ref_loss.item()
    err = ((_grads(params) - ref).norm() / ref.norm()).item()
    assert err <= 1e-6, err


def test_compiled_functional_cached_matches_the_full_batch(compiled):
    from bigbatch.gradcache import cached

    mq, mp, cq, cp = compiled
    dev = next(mq.parameters()).device.type
    params = list(mq.parameters()) + list(mp.parameters())
    q, p = _batch(8, 8, 4, dev), _batch(8, 16, 5, dev)

    @cached
    def encode(model, x):
        return _cls(model(**x))

    for t in params:
        t.grad = None
    torch.manual_seed(7)
    with torch.autocast(dev, dtype=torch.bfloat16):
        ref_loss = _loss(_cls(cq(**q)), _cls(cp(**p)))
    ref_loss.backward()
    ref = _grads(params)
    for t in params:
        t.grad = None
    torch.manual_seed(7)
    with torch.autocast(dev, dtype=torch.bfloat16):
        rq, fq = encode(cq, q)
        rp, fp = encode(cp, p)
    loss = _loss(rq, rp)
    loss.backward()
    fq(rq)
    fp(rp)
    assert loss.item() == ref_loss.item()
    err = ((_grads(params) - ref).norm() / ref.norm()).item()
    assert err <= 1e-6, err
