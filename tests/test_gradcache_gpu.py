"""bigbatch.GradCache on CUDA: the CUDA generator replay, budget probing with the CUDA allocator,
pinned-input offload on a side stream, bf16 autocast and fp16 + GradScaler (run with ``pytest -m gpu``).

The model is a small Hugging Face BERT with dropout in its hidden layers and attention, fed
padded batches (``attention_mask`` with zeros). "Reference" = the same chunks run with one graph
over the whole batch from the same seed (the full-batch gradient for those dropout masks).
"""

from __future__ import annotations

import pytest
import torch

import bigbatch
from bigbatch.gradcache import GradCache, cached_encode
from bigbatch.gradcache.chunking import split_batch, split_rows

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda") if torch.cuda.is_available() else None


def bert(dtype=torch.float32, hidden=64, layers=2, seed=0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=2 * hidden,
                     vocab_size=1000, hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.2)
    return BertModel(cfg).to(DEV, dtype).train()


def batch(b, seq, seed, device=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1000, (b, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (b,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids.to(device or DEV), "attention_mask": mask.to(device or DEV)}


def cls(out):
    return out.last_hidden_state[:, 0]


def loss_fn(q, k):
    return bigbatch.clip_loss(q.float(), k.float(), 10.0)


def grads(models):
    return torch.cat([p.grad.double().flatten() if p.grad is not None else torch.zeros(p.numel(), device=DEV, dtype=torch.float64)
                      for m in models for p in m.parameters()])


def zero(models):
    for m in models:
        for p in m.parameters():
            p.grad = None


def reference(models, inputs, chunks, seed, amp_dtype=None, scale=1.0):
    torch.manual_seed(seed)
    ctx = torch.autocast("cuda", dtype=amp_dtype) if amp_dtype else torch.autocast("cuda", enabled=False)
    with ctx:
        reps = [torch.cat([cls(m(**c)) for c in (split_batch(x, n) if isinstance(n, int) else split_rows(x, n))])
                for m, x, n in zip(models, inputs, chunks)]
        loss = loss_fn(*reps)
    (loss * scale).backward()
    return loss.detach()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_float64_exact_with_dropout_and_padding():
    models = [bert(torch.float64, seed=1), bert(torch.float64, seed=2)]
    q, p = batch(21, 12, 1), batch(21, 24, 2)
    zero(models)
    ref_loss = reference(models, [q, p], [8, 5], seed=3)
    ref = grads(models)
    after_ref = torch.cuda.get_rng_state()
    zero(models)
    torch.manual_seed(3)
    loss = GradCache(models, chunk_sizes=[8, 5], loss_fn=loss_fn, get_rep_fn=cls)(q, p)
    assert torch.equal(torch.cuda.get_rng_state(), after_ref)  # the caller's CUDA stream continues as after a plain pass
    assert abs(loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    assert rel(grads(models), ref) <= 1e-10
    # autograd-native form, shared encoder
    zero(models)
    ref_loss = reference([models[0]] * 2, [q, batch(21, 12, 4)], [6, 6], seed=5)
    ref = grads(models)
    zero(models)
    torch.manual_seed(5)
    a = cached_encode(models[0], q, chunk_size=6, get_rep_fn=cls)
    b = cached_encode(models[0], batch(21, 12, 4), chunk_size=6, get_rep_fn=cls)
    loss_fn(a, b).backward()
    assert rel(grads(models), ref) <= 1e-10


def test_offload_inputs_and_reps_match_on_device_run():
    models = [bert(torch.float64, seed=1), bert(torch.float64, seed=2)]
    q, p = batch(19, 16, 1), batch(19, 16, 2)
    zero(models)
    torch.manual_seed(3)
    GradCache(models, chunk_sizes=4, loss_fn=loss_fn, get_rep_fn=cls)(q, p)
    ref = grads(models)
    zero(models)
    torch.manual_seed(3)
    cpu_q, cpu_p = ({k: v.cpu() for k, v in d.items()} for d in (q, p))
    GradCache(models, chunk_sizes=4, loss_fn=loss_fn, get_rep_fn=cls, offload_inputs=True, offload_reps=True)(cpu_q, cpu_p)
    assert rel(grads(models), ref) <= 1e-12


@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
def test_autocast_against_the_same_chunks(amp_dtype):
    models = [bert(seed=1), bert(seed=2)]
    q, p = batch(48, 16, 1), batch(48, 32, 2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if amp_dtype == torch.float16 else None
    scale = 2.0**10 if scaler is not None else 1.0
    zero(models)
    reference(models, [q, p], [16, 12], seed=3, amp_dtype=amp_dtype, scale=scale)
    ref = grads(models)
    zero(models)
    torch.manual_seed(3)
    GradCache(models, chunk_sizes=[16, 12], loss_fn=loss_fn, get_rep_fn=cls, autocast_dtype=amp_dtype, scaler=scaler)(q, p)
    got = grads(models)
    assert torch.isfinite(got).all()
    assert rel(got, ref) <= 2e-2, rel(got, ref)


def test_fp16_overflow_reaches_the_scaler():
    model = bert(seed=1)
    q, p = batch(16, 8, 1), batch(16, 8, 2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [t.detach().clone() for t in model.parameters()]
    gc = GradCache(model, chunk_sizes=4, loss_fn=lambda a, b: loss_fn(a, b) * float("inf"), get_rep_fn=cls,
                   autocast_dtype=torch.float16, scaler=scaler)
    gc(q, p)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**10  # the step saw non-finite gradients and backed off
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # and the update was skipped


def test_budget_is_respected_and_chunks_are_exact():
    """The CUDA probe sizes the chunks; the device's whole allocation (weights and .grad included)
    stays under the budget at the step's peak."""
    models = [bert(hidden=128, layers=2, seed=1), bert(hidden=128, layers=2, seed=2)]
    q, p = batch(512, 32, 1), batch(512, 128, 2)
    for m in models:
        for t in m.parameters():
            t.grad = torch.zeros_like(t)
    torch.cuda.synchronize()
    budget = torch.cuda.memory_allocated() + 160 * 2**20  # what is allocated already counts
    gc = GradCache(models, loss_fn=loss_fn, get_rep_fn=cls, memory_budget=budget, autocast_dtype=torch.bfloat16)
    gc(q, p)  # probes once, then a measured step
    zero(models)
    for m in models:
        for t in m.parameters():
            t.grad = torch.zeros_like(t)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(3)
    gc(q, p)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    sizes, rows = gc.last_chunk_sizes, gc.last_chunk_rows
    assert sizes[1] < 512, sizes  # the passages had to be chunked
    assert gc.last_kept_rows[1] == rows[1][-1], gc.last_kept_rows  # the last chunk, sized to fit, kept its graph
    assert peak <= budget, f"peak {peak / 2**20:.1f} MiB > budget {budget / 2**20:.0f} MiB (chunks {sizes})"
    with pytest.raises(ValueError, match="already taken by"):
        GradCache(models, loss_fn=loss_fn, get_rep_fn=cls, memory_budget=torch.cuda.memory_allocated() // 2)(q, p)
    got = grads(models)
    zero(models)
    reference(models, [q, p], rows, seed=3, amp_dtype=torch.bfloat16)
    assert rel(got, grads(models)) <= 2e-2


@pytest.mark.parametrize("api", ["GradCache", "cached_encode"])
def test_budget_holds_when_the_step_creates_every_grad(api):
    """After ``zero_grad()`` every ``.grad`` is None: the step creates them (the weights' size again)
    and holds them beside each later chunk's new gradients. The budget must hold all of it."""
    torch.manual_seed(0)
    d = 1024
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()) for _ in range(6)]).to(DEV)
    x, y = torch.randn(1024, d, device=DEV), torch.randn(1024, d, device=DEV)
    clip = lambda a, b: bigbatch.clip_loss(a, b, 5.0)

    costs = []

    def step(budget):
        if api == "GradCache":
            gc = GradCache(model, loss_fn=clip, memory_budget=budget)
            gc(x, y)
            costs[:] = [c for c, _ in gc._prober._cache.values()]
            return gc.last_chunk_rows, gc.last_kept_rows
        a, b = (cached_encode(model, t, memory_budget=budget) for t in (x, y))
        clip(a, b).backward()
        return None

    model(x[:64]).sum().backward()  # library workspaces, as after earlier steps
    for _ in range(2):  # the first step probes; the second is measured
        zero([model])
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        # 24 MiB of weights and as much again of .grad; 24 MiB of activations (each Tanh output, also the
        # next Linear's saved input) and 16 of cached representations with their gradients for the batch:
        # whole, it does not fit. (At 100 MiB it did once the plan was measured, session 16; at 2048 rows
        # and 100 MiB the CLIP loss's own workspace went past the budget's 5% slack: docs/gradcache.md)
        budget = base + 80 * 2**20
        torch.cuda.reset_peak_memory_stats()
        rows = step(budget)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert all(p.grad is not None for p in model.parameters())
    assert peak <= budget, f"peak {(peak - base) / 2**20:.1f} MiB above the start > budget 100 MiB (chunks, kept {rows}; {costs})"
    assert rows is None or len(rows[0][0]) > 1, rows  # chunked, so later chunks sit beside the new .grad


class _TwoGpuModel(torch.nn.Module):
    """Model parallel by hand (as ``device_map="auto"`` places a model): the first layer on cuda:0,
    dropout and the second layer on cuda:1, which draws its masks from cuda:1's generator."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 32).to("cuda:0", torch.float64)
        self.b = torch.nn.Linear(32, 8).to("cuda:1", torch.float64)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x.to("cuda:0"))).to("cuda:1")))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
def test_model_split_over_two_gpus_replays_both_generators(api):
    """Every device holding a parameter has its generator captured and replayed (only the first
    parameter's was before: rel. error 0.82), and the caller's streams end where the plain loop's do."""
    torch.manual_seed(0)
    m = _TwoGpuModel()
    x, y = (torch.randn(12, 6, dtype=torch.float64, device="cuda:0") for _ in range(2))
    loss = lambda a, b: bigbatch.clip_loss(a, b, 5.0)  # noqa: E731

    def streams():
        return [torch.cuda.get_rng_state(d) for d in (0, 1)]

    torch.manual_seed(1)
    loss(*[torch.cat([m(c) for c in split_batch(t, 4)]) for t in (x, y)]).backward()
    ref, ref_streams = [p.grad.clone() for p in m.parameters()], streams()
    m.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    if api == "gradcache":
        GradCache(m, 4, loss, keep_last_graph=False)(x, y)
    else:
        loss(cached_encode(m, x, 4), cached_encode(m, y, 4)).backward()
    for p, r in zip(m.parameters(), ref):
        assert ((p.grad - r).norm() / r.norm()).item() < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(streams(), ref_streams))


@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
def test_lazy_module_with_cuda_dropout_and_eval_before_backward(api):
    """The lazy layer initialises on the GPU inside pass 1 (drawing from the CUDA generator) and,
    for cached_encode, the caller switches to eval before the backward: the same weights and
    gradients as a plain forward over the same chunks (session 8 fixes, CPU-tested elsewhere)."""
    import copy

    from torch import nn

    def make():
        return nn.Sequential(nn.Dropout(0.3), nn.LazyLinear(16, device=DEV, dtype=torch.float64), nn.Tanh(),
                             nn.Dropout(0.3), nn.Linear(16, 8, device=DEV, dtype=torch.float64))

    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(12, 6, generator=g, dtype=torch.float64).to(DEV) for _ in range(2))
    torch.manual_seed(0)
    m = make()
    ref = copy.deepcopy(m)
    torch.manual_seed(5)
    if api == "gradcache":
        GradCache(m, 4, lambda a, b: bigbatch.clip_loss(a, b, 3.0))(x, y)
    else:
        loss = bigbatch.clip_loss(cached_encode(m, x, 4), cached_encode(m, y, 4), 3.0)
        m.eval()
        loss.backward()
    torch.manual_seed(5)
    bigbatch.clip_loss(torch.cat([ref(c) for c in x.split(4)]), torch.cat([ref(c) for c in y.split(4)]), 3.0).backward()
    for p, r in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, r)
        assert rel(p.grad, r.grad) < 1e-12


@pytest.mark.parametrize("api", ["gradcache", "cached_encode"])
def test_parameterless_wrapper_runs_on_its_inputs_gpu(api):
    """Weights applied through torch.func.functional_call by a wrapper that registers nothing: the
    chunks stay on the GPU with the weights (before: staged to the CPU, a device-mismatch error)."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.2), torch.nn.Tanh()).to(DEV, torch.float64)
    weights = {k: v.detach().clone().requires_grad_() for k, v in base.named_parameters()}
    base.requires_grad_(False)

    class Functional(torch.nn.Module):
        def forward(self, v):
            return torch.func.functional_call(base, weights, (v,))

    g = torch.Generator().manual_seed(2)
    x, y = (torch.randn(10, 6, generator=g, dtype=torch.float64).to(DEV) for _ in range(2))
    model = Functional()
    clip = lambda a, b: bigbatch.clip_loss(a, b, 5.0, backend="torch")  # noqa: E731
    torch.manual_seed(1)
    reps = [torch.cat([model(c) for c in split_batch(t, 4)]) for t in (x, y)]
    want = torch.autograd.grad(clip(*reps), list(weights.values()))
    torch.manual_seed(1)
    if api == "gradcache":
        GradCache(model, 4, clip)(x, y)
    else:
        clip(cached_encode(model, x, 4), cached_encode(model, y, 4)).backward()
    for p, w in zip(weights.values(), want):
        assert p.grad.device.type == "cuda"
        assert torch.allclose(p.grad, w, rtol=1e-10, atol=1e-12)


def test_budget_probe_of_a_parameterless_model_leaves_the_cuda_generator_alone():
    """The budget probe forks the random state of the devices the probe runs on: for a wrapper
    that registers nothing, its inputs' GPU (before: none, so the probe's dropout moved the
    caller's CUDA generator and pass 1 drew other masks than a plain step)."""
    base = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)).to(DEV).requires_grad_(False)
    w = {k: v.detach().clone().requires_grad_() for k, v in base.named_parameters()}

    class Functional(torch.nn.Module):
        def forward(self, v):
            return torch.func.functional_call(base, w, (v,))

    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(64, 16, generator=g).to(DEV) for _ in range(2))
    loss = lambda p, q: bigbatch.clip_loss(p, q, 2.0, backend="torch")  # noqa: E731
    torch.manual_seed(0)
    loss(Functional()(x), Functional()(y)).backward()
    want, state = w["0.weight"].grad.clone(), torch.cuda.get_rng_state()
    w["0.weight"].grad = None
    torch.manual_seed(0)
    gc = GradCache(Functional(), None, loss, memory_budget="2GiB")
    gc(x, y)
    assert gc.last_chunk_sizes == [64, 64]
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert torch.allclose(w["0.weight"].grad, want, rtol=1e-5, atol=1e-7)
