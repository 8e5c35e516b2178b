"""bigbatch.GradCache / cached_encode against full-batch gradients (float64, CPU).

"Full batch with the same masks": the reference runs the same chunks *with* a graph, in the
same order and from the same seed, concatenates the representations and back-propagates the
loss once -- the full-batch gradient of a model whose dropout draws those masks. Without dropout
the reference is one plain forward over the whole batch.
"""

from __future__ import annotations

import contextlib
from collections import UserDict

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import bigbatch
from bigbatch.gradcache import GradCache, cached_encode, parse_memory
from bigbatch.gradcache.chunking import planned_rows, split_batch, split_rows

from helpers import assert_rel, rel_err

F64 = torch.float64
TOL = 1e-10


class Enc(nn.Module):
    """Dropout + LayerNorm encoder taking a tensor, keyword tensors, or two positional tensors."""

    def __init__(self, d_in: int = 6, d: int = 8, p: float = 0.3) -> None:
        super().__init__()
        self.l1, self.l1b = nn.Linear(d_in, 16), nn.Linear(d_in, 16)
        self.drop, self.ln, self.l2 = nn.Dropout(p), nn.LayerNorm(16), nn.Linear(16, d)

    def forward(self, x=None, extra=None, *, input_ids=None, mask=None):
        if input_ids is not None:
            x, extra = input_ids, mask
        h = self.l1(x) if extra is None else self.l1(x) + self.l1b(extra)
        return self.l2(self.ln(self.drop(torch.tanh(h))))


def make_models(n: int, seed: int = 0, p: float = 0.3):
    torch.manual_seed(seed)
    return [Enc(p=p).to(F64) for _ in range(n)]


def make_input(kind: str, b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a, c = torch.randn(b, 6, generator=g, dtype=F64), torch.randn(b, 6, generator=g, dtype=F64)
    if kind == "tensor":
        return a
    if kind == "dict":
        return {"input_ids": a, "mask": c}
    if kind == "batchencoding":
        from transformers import BatchEncoding

        return BatchEncoding({"input_ids": a, "mask": c})
    if kind == "userdict":
        return UserDict({"input_ids": a, "mask": c})
    if kind == "tuple":
        return (a, c)
    raise AssertionError(kind)


def call(model, x):
    if isinstance(x, torch.Tensor):
        return model(x)
    if isinstance(x, tuple):
        return model(*x)
    return model(**x)


def params_of(models, extra=()):
    seen, out = set(), []
    for m in list(models) + list(extra):
        for p in (m.parameters() if isinstance(m, nn.Module) else [m]):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def zero(params):
    for p in params:
        p.grad = None


def grads(params):
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]


def cut(x, n):
    """Chunks of ``x``: ``n`` rows each (the short chunk last, as GradCache with chunk_sizes=n), or the
    row counts of a list (``gc.last_chunk_rows[i]`` of a budget-sized step)."""
    return split_batch(x, n) if isinstance(n, int) else split_rows(x, n)


def reference(models, inputs, chunk, loss_fn, seed, autocast=None, **loss_kwargs):
    """(loss, grads): the same chunks with one graph over the whole batch (same RNG draws)."""
    ms = models * len(inputs) if len(models) == 1 else models
    chunks = [chunk] * len(inputs) if isinstance(chunk, int) else chunk
    torch.manual_seed(seed)
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    with ctx:
        reps = [torch.cat([call(m, c) for c in cut(x, n)]) for m, x, n in zip(ms, inputs, chunks)]
        loss = loss_fn(*reps, **loss_kwargs)
    loss.backward()
    return loss.detach()


def full_batch_grads(models, params, x, y):
    """Gradients of one plain forward over the whole batch (models without dropout)."""
    zero(params)
    clip()(models[0](x), models[1](y)).backward()
    out = grads(params)
    zero(params)
    return out


def clip(scale=5.0):
    return lambda a, b: bigbatch.clip_loss(a, b, scale)


def check_grads(params, ref, tol, what=""):
    """Per-parameter relative error, with the reference norm floored at 1e-6 of the whole
    gradient's norm: some gradients are zero in exact arithmetic (a softmax over keys is
    invariant to shifting every key, so the key encoder's output bias gets sum-zero gradients)."""
    got = grads(params)
    total = torch.sqrt(sum(r.double().pow(2).sum() for r in ref)).item()
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape and torch.isfinite(g).all(), f"{what} grad {i}: shape or non-finite"
        err = (g.double() - r.double()).norm().item() / max(r.double().norm().item(), 1e-6 * total, 1e-300)
        assert err <= tol, f"{what} grad of parameter {i}: relative error {err:.3e} > {tol:.1e}"


@pytest.mark.parametrize("kind", ["tensor", "dict", "batchencoding", "userdict", "tuple"])
@pytest.mark.parametrize("shared", [True, False])
def test_exact_with_dropout(kind, shared):
    models = make_models(1 if shared else 2)
    params = params_of(models)
    x, y = make_input(kind, 11, 1), make_input(kind, 11, 2)
    zero(params)
    ref_loss = reference(models, [x, y], 4, clip(), seed=7)
    ref = grads(params)
    zero(params)
    torch.manual_seed(7)
    loss = GradCache(models, chunk_sizes=4, loss_fn=clip())(x, y)
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    check_grads(params, ref, TOL)
    # the caller's random stream ends where an ordinary forward over the same chunks leaves it
    after_gc = torch.rand(3)
    reference(models, [x, y], 4, clip(), seed=7)
    assert torch.equal(after_gc, torch.rand(3))


@pytest.mark.parametrize("keep", [True, False])
def test_no_dropout_equals_one_full_forward(keep):
    models = make_models(2, p=0.0)
    params = params_of(models)
    x, y = make_input("tensor", 10, 3), make_input("tensor", 10, 4)
    ref = full_batch_grads(models, params, x, y)
    gc = GradCache(models, chunk_sizes=[3, 4], loss_fn=clip(), keep_last_graph=keep)
    gc(x, y)
    assert gc.last_kept == (1 if keep else 0)
    check_grads(params, ref, TOL)


def test_dropout_masks_differ_without_replay():
    """Guard that the dropout test can fail: without RNG replay the second pass draws new masks."""
    from bigbatch.gradcache import rng

    models = make_models(1)
    params = params_of(models)
    x, y = make_input("tensor", 8, 1), make_input("tensor", 8, 2)
    zero(params)
    reference(models, [x, y], 4, clip(), seed=3)
    ref = grads(params)
    zero(params)
    original = rng.RngState.replay
    import contextlib

    rng.RngState.replay = lambda self: contextlib.nullcontext()
    try:
        torch.manual_seed(3)
        GradCache(models, chunk_sizes=4, loss_fn=clip(), keep_last_graph=False)(x, y)
    finally:
        rng.RngState.replay = original
    errs = [bigbatch_rel(g, r) for g, r in zip(grads(params), ref)]
    assert max(errs) > 1e-3


def bigbatch_rel(a, b):
    from helpers import rel_err

    return rel_err(a, b)


def test_cached_encode_in_own_loss():
    models = make_models(2)
    scale = torch.tensor(1.5, dtype=F64, requires_grad=True)
    params = params_of(models, [scale])
    x, y = make_input("dict", 9, 5), make_input("tensor", 9, 6)

    def loss_fn(a, b):
        return bigbatch.infonce_loss(a, b, scale.exp()) + 0.1 * a.pow(2).mean()

    zero(params)
    reference(models, [x, y], 4, loss_fn, seed=11)
    ref = grads(params)
    zero(params)
    torch.manual_seed(11)
    a = cached_encode(models[0], x, chunk_size=4)
    b = cached_encode(models[1], y, chunk_size=4, keep_last_graph=True)
    assert a.requires_grad and a.grad_fn is not None
    loss_fn(a, b).backward()
    check_grads(params, ref, TOL)
    with torch.no_grad():
        assert cached_encode(models[0], x, chunk_size=4).grad_fn is None


def test_parameterised_head_gets_exact_grads():
    """GradCache paper section 5: a learned bilinear similarity inside the loss."""
    models = make_models(2)
    torch.manual_seed(1)
    head = nn.Linear(8, 8, bias=False).to(F64)
    params = params_of(models, [head])
    x, y = make_input("tensor", 12, 1), make_input("tensor", 12, 2)

    def loss_fn(a, b, temperature):
        return nn.functional.cross_entropy(head(a) @ b.T / temperature, torch.arange(a.shape[0]))

    zero(params)
    reference(models, [x, y], 5, loss_fn, seed=2, temperature=0.5)
    ref = grads(params)
    zero(params)
    torch.manual_seed(2)
    GradCache(models, chunk_sizes=5, loss_fn=loss_fn)(x, y, temperature=0.5)
    check_grads(params, ref, TOL)


def test_learned_scale_with_clip_loss_and_accumulation():
    models = make_models(1)
    log_scale = torch.tensor(2.0, dtype=F64, requires_grad=True)
    params = params_of(models, [log_scale])
    batches = [(make_input("tensor", 7, s), make_input("tensor", 7, s + 10)) for s in (1, 2)]

    def loss_fn(a, b):
        return bigbatch.clip_loss(a, b, log_scale.exp())

    zero(params)
    for i, (x, y) in enumerate(batches):
        reference(models, [x, y], 3, loss_fn, seed=20 + i)
    ref = grads(params)
    zero(params)
    gc = GradCache(models, chunk_sizes=3, loss_fn=loss_fn)
    for i, (x, y) in enumerate(batches):  # two cached steps accumulate into .grad
        torch.manual_seed(20 + i)
        gc(x, y)
    check_grads(params, ref, TOL)


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 13), chunk=st.integers(1, 14), d_in=st.integers(1, 5), seed=st.integers(0, 10**6),
       keep=st.booleans())
def test_random_shapes(b, chunk, d_in, seed, keep):
    torch.manual_seed(seed)
    enc = nn.Sequential(nn.Linear(d_in, 7), nn.Dropout(0.25), nn.LayerNorm(7), nn.Linear(7, 5)).to(F64)
    head = torch.tensor(0.7, dtype=F64, requires_grad=True)
    params = params_of([enc], [head])
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(b, d_in, generator=g, dtype=F64), torch.randn(b + 2, d_in, generator=g, dtype=F64)

    def loss_fn(a, k):
        return bigbatch.infonce_loss(a, k, head.exp(), labels=torch.arange(a.shape[0]))

    zero(params)
    reference([enc], [x, y], chunk, loss_fn, seed=seed)
    ref = grads(params)
    zero(params)
    torch.manual_seed(seed)
    GradCache(enc, chunk_sizes=chunk, loss_fn=loss_fn, keep_last_graph=keep)(x, y)
    check_grads(params, ref, 1e-9)


def test_bf16_autocast():
    models = [m.float() for m in make_models(2)]
    params = params_of(models)
    x, y = make_input("tensor", 12, 1).float(), make_input("tensor", 12, 2).float()
    zero(params)
    reference(models, [x, y], 4, clip(), seed=3, autocast=torch.bfloat16)
    ref = grads(params)
    zero(params)
    torch.manual_seed(3)
    GradCache(models, chunk_sizes=4, loss_fn=clip(), autocast_dtype=torch.bfloat16)(x, y)
    got = grads(params)
    # not bitwise: the reference sums the chunks' weight gradients in bf16 (one autocast weight
    # cast shared by all chunks), GradCache in fp32 (one backward per chunk)
    check_grads(params, ref, 2e-2, "bf16 (same autocast)")
    # against the float64 truth with the same masks: as close as the bf16 full-batch graph is
    models64 = make_models(2)
    for a, b in zip(models64, models):
        a.load_state_dict({k: v.double() for k, v in b.state_dict().items()})
    p64 = params_of(models64)
    zero(p64)
    reference(models64, [x.double(), y.double()], 4, clip(), seed=3)
    truth = grads(p64)
    flat = lambda gs: torch.cat([g.double().flatten() for g in gs])  # noqa: E731
    err_gc, err_ref = rel_err(flat(got), flat(truth)), rel_err(flat(ref), flat(truth))
    assert err_gc <= 2e-2, err_gc
    assert err_gc <= 1.5 * err_ref + 1e-3, (err_gc, err_ref)


def test_autocast_weight_casts_do_not_grow_with_chunks():
    """Under autocast_dtype the chunks of one pass share autocast's cast of each weight: the number
    of fp32 -> half weight casts per step does not depend on the number of chunks."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    models = [m.float() for m in make_models(2)]
    x, y = make_input("tensor", 16, 1).float(), make_input("tensor", 16, 2).float()
    owner = {p.data_ptr(): (i, n) for i, m in enumerate(models) for n, p in m.named_parameters()}

    def casts(chunk):
        counts = Counter()

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in owner:
                    counts[owner[args[0].data_ptr()]] += 1
                return func(*args, **(kwargs or {}))

        with Count():
            GradCache(models, chunk_sizes=chunk, loss_fn=clip(), autocast_dtype=torch.bfloat16)(x, y)
        return counts

    few, many = casts(8), casts(2)  # 2 and 8 chunks per input
    assert few and few == many, (few, many)
    assert max(many.values()) <= 3, many  # one cast per pass (+1 at most for a kept chunk's graph)


def test_fp16_grad_scaler_scaled_cache_and_skip():
    models = [m.float() for m in make_models(2)]
    params = params_of(models)
    x, y = make_input("tensor", 8, 1).float(), make_input("tensor", 8, 2).float()
    zero(params)
    reference(models, [x, y], 4, clip(), seed=5, autocast=torch.float16)
    ref = grads(params)
    zero(params)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(params, lr=0.1)
    torch.manual_seed(5)
    gc = GradCache(models, chunk_sizes=4, loss_fn=clip(), scaler=scaler, autocast_dtype=torch.float16)
    gc(x, y)
    check_grads(params, [r * 2.0**10 for r in ref], 5e-3, "scaled grads")
    scaler.unscale_(opt)
    check_grads(params, ref, 5e-3, "unscaled grads")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**10
    # a scale that overflows fp16 cached gradients: the scaler must skip the step and back off
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    zero(params)
    before = [p.detach().clone() for p in params]
    opt2 = torch.optim.SGD(params, lr=0.1)
    GradCache(models, chunk_sizes=4, loss_fn=clip(), scaler=scaler2, autocast_dtype=torch.float16)(x, y)
    assert not all(torch.isfinite(p.grad).all() for p in params)
    scaler2.step(opt2)
    scaler2.update()
    assert scaler2.get_scale() < 2.0**40
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b), "the optimizer stepped on non-finite gradients"


def test_enabled_scaler_without_fp16_is_an_error_not_a_scaled_gradient():
    """The public GradCache ignores a scaler unless fp16=True; bigbatch scaled the loss anyway, so
    .grad came out 65536x the full-batch gradient (a migrated loop calling optimizer.step() when
    fp16 is off then takes a 65536x step). Refused, with the way out; a disabled scaler (the usual
    GradScaler(enabled=use_fp16)) and a caller's float16 autocast region are fine."""
    models = [m.float() for m in make_models(2)]
    params = params_of(models)
    x, y = make_input("tensor", 8, 1).float(), make_input("tensor", 8, 2).float()
    for kwargs in ({}, {"autocast_dtype": torch.bfloat16}):
        gc = GradCache(models, chunk_sizes=4, loss_fn=clip(), scaler=torch.amp.GradScaler("cpu"), **kwargs)
        with pytest.raises(ValueError, match="an enabled scaler without fp16"):
            gc(x, y)
    zero(params)
    reference(models, [x, y], 4, clip(), seed=5)
    ref = grads(params)
    zero(params)
    torch.manual_seed(5)
    GradCache(models, chunk_sizes=4, loss_fn=clip(), scaler=torch.amp.GradScaler("cpu", enabled=False))(x, y)
    check_grads(params, ref, 1e-6, "disabled scaler")
    zero(params)
    reference(models, [x, y], 4, clip(), seed=5, autocast=torch.float16)
    ref16 = grads(params)
    zero(params)
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.float16):
        GradCache(models, chunk_sizes=4, loss_fn=clip(), scaler=torch.amp.GradScaler("cpu", init_scale=4.0))(x, y)
    check_grads(params, [r * 4.0 for r in ref16], 5e-3, "scaled grads under the caller's fp16 autocast")


def test_offload_inputs_and_reps_exact():
    models = make_models(2)
    params = params_of(models)
    x, y = make_input("dict", 10, 1), make_input("tensor", 10, 2)
    zero(params)
    reference(models, [x, y], 3, clip(), seed=9)
    ref = grads(params)
    zero(params)
    torch.manual_seed(9)
    GradCache(models, chunk_sizes=3, loss_fn=clip(), offload_inputs=True, offload_reps=True)(x, y)
    check_grads(params, ref, TOL)


def test_offloaded_representations_leave_the_device_before_the_re_runs():
    """With offload_reps the plan counts neither the representations nor their gradients on the
    device: no tensor may hold the representations' storage during the re-runs (before: the B x D
    leaves, the loss's graph and a loop variable kept them; reviews' findings -- the offloaded H200
    step peaked 0.1 GiB above the plain one)."""
    import gc

    models = make_models(2)
    x, y = make_input("tensor", 10, 1), make_input("tensor", 10, 2)
    storages, alive = [], []

    def loss_fn(a, b):  # the loss gets clones of the cached leaves: their AccumulateGrad holds the leaf
        storages.extend(t.grad_fn.next_functions[0][0].variable.untyped_storage().data_ptr() for t in (a, b))
        return clip()(a, b)

    def storage_of(t):
        # the whole batch's (10, 8) representation only: a freed one's address may be reused by a
        # re-run's smaller tensors; other tests' sparse, meta or wrapped tensors have no storage
        try:
            return t.untyped_storage().data_ptr() if t.layout == torch.strided and t.shape == (10, 8) else None
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def holders():
        gc.collect()
        found = [storage_of(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        return [found.count(p) for p in storages]

    def in_pass_two(module, args):
        if storages:
            alive.append(holders())

    hooks = [m.register_forward_pre_hook(in_pass_two) for m in models]
    GradCache(models, chunk_sizes=3, loss_fn=loss_fn, offload_reps=True)(x, y)
    assert alive and all(n == [0, 0] for n in alive), alive
    storages.clear(), alive.clear()
    GradCache(models, chunk_sizes=3, loss_fn=loss_fn)(x, y)  # without offloading they stay (the plan counts them)
    assert alive and all(min(n) >= 1 for n in alive), alive
    for h in hooks:
        h.remove()


def test_auto_chunk_from_budget_on_cpu():
    models = make_models(2)
    params = params_of(models)
    x, y = make_input("tensor", 40, 1), make_input("tensor", 40, 2)
    gc = GradCache(models, loss_fn=clip(), memory_budget="24KiB")
    zero(params)
    torch.manual_seed(4)
    gc(x, y)
    sizes, rows = gc.last_chunk_sizes, gc.last_chunk_rows
    assert all(1 <= s < 40 for s in sizes), sizes
    assert [r[-1] for r in rows] == sizes and [sum(r) for r in rows] == [40, 40]  # the largest chunk last
    got = grads(params)
    zero(params)
    reference(models, [x, y], rows, clip(), seed=4)
    for i, (g, r) in enumerate(zip(got, grads(params))):
        assert_rel(g, r, TOL, f"auto-chunk grad {i}")
    big = GradCache(models, loss_fn=clip(), memory_budget=2**30)
    big(x, y)
    assert big.last_chunk_sizes == [40, 40]
    with pytest.raises(ValueError, match="chunk_sizes=<rows per chunk> or memory_budget"):
        GradCache(models, loss_fn=clip())(x, y)
    with pytest.raises(ValueError, match="too small for even one example"):
        # > the cached representations (and the .grad of l1b, which this input leaves unused and None)
        GradCache(models, loss_fn=clip(), memory_budget=13_500)(x, y)


def test_parse_memory():
    assert parse_memory("16GiB") == 16 * 2**30
    assert parse_memory("1.5 MB") == 1_500_000
    assert parse_memory(1024) == 1024
    assert parse_memory(None) is None
    for bad in ("16 parsecs", "-3GiB", "GiB", 0):
        with pytest.raises(ValueError, match="memory_budget"):
            parse_memory(bad)
    with pytest.raises(TypeError, match="memory_budget"):
        parse_memory([1])
    # numpy numbers are numbers (np.int64 was refused as "got int64", while chunk_sizes took it);
    # a string too long for a float was a raw OverflowError
    import numpy as np

    assert parse_memory(np.int64(4096)) == 4096 and parse_memory(np.float32(2048.0)) == 2048
    for bad in ("9" * 400, float("nan"), np.float64("inf")):
        with pytest.raises(ValueError, match="memory_budget"):
            parse_memory(bad)
    from fractions import Fraction

    assert parse_memory(10**400) == 10**400 and parse_memory(Fraction(10**400, 3)) == 10**400 // 3  # huge is fine
    for tiny in (0.3, "0.0001B"):  # said "must be positive, got 0.3"
        with pytest.raises(ValueError, match=r"must be positive, got .* \(it rounds down to 0 bytes\)"):
            parse_memory(tiny)
    for zero in (0, "0", "0GiB", 0.0):
        with pytest.raises(ValueError, match=r"must be positive, got [^(]*$"):
            parse_memory(zero)


def test_bad_arguments():
    m = make_models(2)
    x = make_input("tensor", 6, 1)
    with pytest.raises(TypeError, match="loss_fn"):
        GradCache(m, chunk_sizes=2)
    with pytest.raises(TypeError, match="models"):
        GradCache([], chunk_sizes=2, loss_fn=clip())
    with pytest.raises(ValueError, match="chunk_sizes"):
        GradCache(m, chunk_sizes=0, loss_fn=clip())
    with pytest.raises(ValueError, match="ddp_sync"):
        GradCache(m, chunk_sizes=2, loss_fn=clip(), ddp_sync="sometimes")
    with pytest.raises(ValueError, match="autocast_dtype"):
        GradCache(m, chunk_sizes=2, loss_fn=clip(), autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match="3 inputs for 2 models"):
        GradCache(m, chunk_sizes=2, loss_fn=clip())(x, x, x)
    with pytest.raises(ValueError, match="chunk_sizes has 3 entries"):
        GradCache(m, chunk_sizes=[2, 2, 2], loss_fn=clip())(x, x)
    with pytest.raises(ValueError, match="batch size"):
        GradCache(m[0], chunk_sizes=2, loss_fn=clip())({"input_ids": x, "mask": x[:5]}, x)
    with pytest.raises(ValueError, match="scalar"):
        GradCache(m, chunk_sizes=2, loss_fn=lambda a, b: a @ b.T)(x, x)
    with pytest.raises(TypeError, match="get_rep_fn"):
        GradCache(m, chunk_sizes=2, loss_fn=clip(), get_rep_fn=lambda out: out.tolist())(x, x)
    with pytest.raises(ValueError, match="dimension 0"):
        GradCache(m, chunk_sizes=2, loss_fn=clip(), get_rep_fn=lambda out: out.T)(x, x)
    with pytest.raises(ValueError, match="empty batch"):
        GradCache(m, chunk_sizes=2, loss_fn=clip())(x[:0], x[:0])
    with pytest.raises(ValueError, match="chunk_size"):
        cached_encode(m[0], x, chunk_size=-1)


def test_no_kept_graph_survives_an_error():
    m = make_models(1)
    x = make_input("tensor", 6, 1)

    def failing(a, b):
        raise RuntimeError("boom")

    gc = GradCache(m, chunk_sizes=3, loss_fn=failing)
    with pytest.raises(RuntimeError, match="boom"):
        gc(x, x)


def test_split_batch_short_last_and_types():
    from transformers import BatchEncoding

    x = BatchEncoding({"input_ids": torch.arange(10).view(10, 1), "flag": torch.tensor(1.0), "name": "q"})
    chunks = split_batch(x, 4)
    assert [c["input_ids"].shape[0] for c in chunks] == [4, 4, 2]
    assert all(isinstance(c, BatchEncoding) and c["name"] == "q" and c["flag"].dim() == 0 for c in chunks)
    assert torch.equal(torch.cat([c["input_ids"] for c in chunks]), x["input_ids"])
    assert [c.shape[0] for c in split_batch(torch.zeros(10, 2), 4)] == [4, 4, 2]


def test_cached_representations_do_not_pin_model_outputs():
    """A get_rep_fn that slices (``out[:, 0]``) must not keep every chunk's full output alive."""
    from bigbatch.gradcache.engine import compact

    big = torch.randn(6, 50, 4)
    view = big[:, 0]
    c = compact(view)
    assert torch.equal(c, view) and c.untyped_storage().nbytes() == c.numel() * c.element_size()
    dense = torch.randn(6, 4)
    assert compact(dense).data_ptr() == dense.data_ptr()  # no copy when nothing is pinned


def test_chunk_size_rule():
    from bigbatch.gradcache.budget import ChunkCost

    assert planned_rows(512, 308) == [204, 308]
    assert planned_rows(1024, 308) == [238, 239, 239, 308]  # no 100-row chunk: the rest split evenly
    assert planned_rows(2048, 308) == [290, 290, 290, 290, 290, 290, 308]
    assert planned_rows(300, 308) == [300] and planned_rows(3, 5) == [3] and planned_rows(7, 1) == [1] * 7
    assert planned_rows(13, 12) == [2, 11] and planned_rows(14, 12) == [2, 12]  # no one-row chunk
    for b in range(1, 60):
        for fit in range(1, 20):
            rows = planned_rows(b, fit)
            last = fit - 1 if b == fit + 1 and fit >= 3 else min(b, fit)
            assert sum(rows) == b and max(rows) == rows[-1] == last and max(rows) - min(rows[:-1] or rows) <= fit
            assert len(rows) == -(-b // fit) and (len(rows) < 3 or max(rows[:-1]) - min(rows[:-1]) <= 1)
            assert min(rows) >= 2 or fit < 3 or b < 2, (b, fit, rows)
    cost = ChunkCost(fixed=100.0, per_row=10.0, act_per_row=5.0)
    assert cost.largest_chunk(100 + 10 * 30, 1000) == 30
    assert cost.largest_chunk(100 + 10 * 30, 20) == 20


def test_budget_plan_gives_batchnorm_no_one_row_chunk(monkeypatch):
    """A budget fitting 12 rows and a 13-row batch: chunks 2 + 11 (1 + 12 failed BatchNorm in
    training, which the batch itself passes), and the step equals the same chunks in one graph."""
    from bigbatch.gradcache.budget import ChunkCost

    monkeypatch.setattr(ChunkCost, "largest_chunk", lambda self, budget, cap: min(cap, 12))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 4))
    x, y = torch.randn(13, 5), torch.randn(13, 5)
    loss_fn = lambda a, b: bigbatch.clip_loss(a, b, 2.0)  # noqa: E731
    gc = GradCache([model], loss_fn=loss_fn, memory_budget="1GiB")
    gc(x, y)
    assert gc.last_chunk_rows == [[2, 11], [2, 11]]
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    chunks = lambda t: [model(c) for c in t.split([2, 11])]  # noqa: E731
    ref = loss_fn(torch.cat(chunks(x)), torch.cat(chunks(y)))
    ref.backward()
    for a, p in zip(got, model.parameters()):
        assert rel_err(a, p.grad) <= 1e-5


def test_budget_leaves_room_for_the_cached_representations():
    """The whole batch's representations and their gradients live through the step: chunks are
    planned in what the budget leaves after them (and with offload_reps they are not counted)."""
    from bigbatch.gradcache.budget import ChunkCost, planning_budget

    cost = ChunkCost(fixed=0.0, per_row=1.0, act_per_row=1.0, rep_per_row=8.0)
    assert cost.cached(100) == 1600.0
    assert planning_budget(10_000, 0.95, cost.cached(100)) == 9500 - 1600
    with pytest.raises(ValueError, match="cached representations.*offload_reps=True"):
        planning_budget(10_000, 0.95, cost.cached(1000))
    # what is allocated before the step (on CUDA) comes out of the budget first
    assert planning_budget(10_000, 0.95, cost.cached(100), in_use=2_000) == int(8_000 * 0.95) - 1600
    with pytest.raises(ValueError, match=r"already taken by.*allocated before the step"):
        planning_budget(10_000, 0.95, 0.0, in_use=10_000)
    models = make_models(2)
    x, y = make_input("tensor", 40, 1), make_input("tensor", 40, 2)
    gc = GradCache(models, loss_fn=clip(), memory_budget="24KiB")
    gc(x, y)
    probed = [cost for cost, _ in gc._prober._cache.values()]
    assert probed and all(c.rep_per_row == 8 * 8 for c in probed)  # float64 (rows, 8) representations
    with pytest.raises(ValueError, match="cached representations"):  # 2 x 2 x 5000 x D x 4 bytes > 1 MiB
        GradCache(models, loss_fn=clip(), memory_budget="1MiB")(make_input("tensor", 5000, 1), make_input("tensor", 5000, 2))
    # on the CPU, offload_reps moves nothing: the representations still count, and the error does
    # not advise it (before: accepted, with the same memory beyond the budget just enforced)
    with pytest.raises(ValueError, match="cached representations") as err:
        GradCache(models, loss_fn=clip(), memory_budget="1MiB", offload_reps=True)(
            make_input("tensor", 5000, 1), make_input("tensor", 5000, 2))
    assert "offload_reps" not in str(err.value)
    with pytest.raises(ValueError, match="cached representations") as err:
        cached_encode(models[0], make_input("tensor", 10000, 1), memory_budget="1MiB", offload_reps=True)
    assert "offload_reps" not in str(err.value)
    with pytest.raises(ValueError, match=r"cached representations.*raise it well above [0-9.]+ (B|KiB|MiB|GiB)$"):
        planning_budget(10_000, 0.95, cost.cached(1000), can_offload=False)


def test_cached_encode_sized_from_a_budget():
    """cached_encode with memory_budget: the batch is chunked (largest chunk last) and the
    gradient is the full batch's (no dropout, so any chunking must give the same gradient)."""
    models = make_models(2, p=0.0)
    params = params_of(models)
    x, y = make_input("tensor", 40, 1), make_input("tensor", 40, 2)
    ref = full_batch_grads(models, params, x, y)
    calls = []
    hook = models[1].register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    a = cached_encode(models[0], x, memory_budget="24KiB")
    b = cached_encode(models[1], y, memory_budget="24KiB")
    clip()(a, b).backward()
    hook.remove()
    check_grads(params, ref, TOL, "cached_encode with a budget")
    calls = calls[2:]  # after the two probe chunks (16 and 40 rows): pass 1, then the re-runs
    n = next(i for i in range(1, len(calls) + 1) if sum(calls[:i]) == 40)
    rows, reruns = calls[:n], calls[n:]
    assert len(rows) > 1 and rows[-1] == max(rows) and max(rows) - min(rows[:-1]) <= rows[-1], calls
    assert reruns == rows, calls  # keep_last_graph is off by default in cached_encode: all re-run


@pytest.mark.parametrize("keep", [True, False])
def test_frozen_tower(keep):
    """A locked encoder (no parameter requires grad, as in LiT) is encoded once without a graph
    and never re-run; the trainable tower and the loss get the full-batch gradients."""
    models = make_models(2)
    for p in models[0].parameters():
        p.requires_grad_(False)
    params = params_of(models)
    x, y = make_input("dict", 11, 1), make_input("dict", 11, 2)
    zero(params)
    ref_loss = reference(models, [x, y], 4, clip(), seed=7)
    ref = grads(params)
    zero(params)
    torch.manual_seed(7)
    calls = []
    hook = models[0].register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    gc = GradCache(models, chunk_sizes=4, loss_fn=clip(), keep_last_graph=keep)
    loss = gc(x, y)
    hook.remove()
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
    check_grads(params, ref, TOL, "frozen tower")
    assert calls == [4, 4, 3] and gc.last_kept_rows[0] == 0  # one pass, nothing kept for the frozen tower
    assert gc.last_kept_rows[1] == (3 if keep else 0)
    after = torch.rand(3)
    reference(models, [x, y], 4, clip(), seed=7)
    assert torch.equal(after, torch.rand(3))
    # sized from a budget: the frozen tower's chunks come from its no-grad forward
    zero(params)
    torch.manual_seed(7)
    sized = GradCache(models, memory_budget="24KiB", loss_fn=clip())
    sized(x, y)
    got = grads(params)
    zero(params)
    reference(models, [x, y], sized.last_chunk_rows, clip(), seed=7)
    for i, (g, r) in enumerate(zip(got, grads(params))):
        assert_rel(g, r, TOL, f"budget, frozen tower, grad {i}")
    for p in models[1].parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no grad_fn"):
        GradCache(models, chunk_sizes=4, loss_fn=clip())(x, y)


def test_kept_graph_leaves_room_for_later_frozen_forwards():
    """A kept graph is alive while the chunks after it run their pass-1 forwards: with a frozen
    encoder after it, the plan keeps it only if its activations fit beside that no-grad peak."""
    from bigbatch.gradcache.budget import ChunkCost
    from bigbatch.gradcache.engine import Unit

    gc = GradCache(nn.Linear(2, 2), chunk_sizes=1, loss_fn=clip())
    m = nn.Linear(2, 2)
    costs = [ChunkCost(fixed=0.0, per_row=10.0, act_per_row=8.0), ChunkCost(fixed=0.0, per_row=5.0, act_per_row=0.0)]
    for usable, want in ((60, [False, True, False]), (45, [False, False, False]), (100, [True, True, False])):
        units = [Unit(0, m, None, 4), Unit(0, m, None, 4), Unit(1, m, None, 4)]
        gc._plan_keep(units, costs, usable, [True, False])
        assert [u.keep for u in units] == want, (usable, [u.keep for u in units])


def test_a_chunk_that_fits_the_budget_can_always_be_kept():
    """A kept graph is part of its chunk's forward + backward peak, so the last chunk, sized to
    fit, is kept even when the probe's two-point line for the held graph overshoots the peak line
    (as on an H200: the fixed half-precision weight copies made the held line steeper)."""
    from bigbatch.gradcache.budget import ChunkCost
    from bigbatch.gradcache.engine import Unit

    gc = GradCache(nn.Linear(2, 2), chunk_sizes=1, loss_fn=clip())
    m = nn.Linear(2, 2)
    cost = ChunkCost(fixed=100.0, per_row=10.0, act_per_row=14.0, act_fixed=50.0)
    assert cost.held(30) == cost.peak(30) == 400.0 and cost.held(1) == 64.0
    usable = 400
    units = [Unit(0, m, None, 25), Unit(0, m, None, 30)]
    gc._plan_keep(units, [cost], usable, [True])
    assert [u.keep for u in units] == [False, True]


class _LayerDrop(nn.Module):
    """Skips its block with probability 1/2 drawn from Python's ``random`` and adds NumPy noise:
    randomness outside torch's generators, which a re-run must replay as well."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.block, self.l2 = nn.Linear(6, 10), nn.Linear(10, 10), nn.Linear(10, 8)

    def forward(self, x):
        import numpy as np
        import random

        h = torch.tanh(self.l1(x))
        if random.random() < 0.5:
            h = h + torch.tanh(self.block(h))
        noise = torch.as_tensor(np.random.standard_normal(h.shape[1]), dtype=h.dtype)
        return self.l2(h * (1 + 0.1 * noise))


def test_python_and_numpy_random_draws_are_replayed():
    import numpy as np
    import random

    torch.manual_seed(0)
    models = [_LayerDrop().to(F64), _LayerDrop().to(F64)]
    params = params_of(models)
    x, y = make_input("tensor", 13, 1), make_input("tensor", 13, 2)
    random.seed(11)
    np.random.seed(12)
    reference(models, [x, y], 3, clip(), seed=0)
    ref, ref_after = grads(params), (random.random(), np.random.standard_normal())
    zero(params)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(0)
    GradCache(models, chunk_sizes=3, loss_fn=clip(), keep_last_graph=False)(x, y)
    check_grads(params, ref, TOL, "python/numpy random")
    assert (random.random(), np.random.standard_normal()) == ref_after  # the streams continue as after one pass


def test_cuda_probe_discards_a_first_unmeasured_run(monkeypatch):
    """One-time allocations of a first forward + backward must not enter the fitted line: on CUDA
    the small chunk runs once unmeasured. Simulated: the first measurement carries a one-time
    extra; the fitted slope must be the true one."""
    from bigbatch.gradcache import budget

    calls = []

    def fake_measure(model, x, get_rep, autocast_ctx, params, device, by_grad=True):
        rows = x.shape[0]
        one_time = 1000.0 if not calls else 0.0
        calls.append(rows)
        return 100.0 + 10.0 * rows + one_time, 5.0 * rows, 8.0 * rows

    monkeypatch.setattr(budget, "_measure", fake_measure)
    monkeypatch.setattr(budget, "model_device", lambda m, x=None: torch.device("cuda", 0))
    monkeypatch.setattr(budget, "to_device", lambda x, d: x)
    monkeypatch.setattr(budget, "forked_rng", lambda devices: contextlib.nullcontext())
    cost = budget.ChunkProber().cost(nn.Linear(6, 8), torch.zeros(100, 6), lambda o: o, contextlib.nullcontext, None)
    assert calls == [16, 16, 48]
    assert cost.per_row == 10.0 and cost.fixed == 100.0
    calls.clear()
    monkeypatch.setattr(budget, "model_device", lambda m, x=None: torch.device("cpu"))
    budget.ChunkProber().cost(nn.Linear(6, 8), torch.zeros(100, 6), lambda o: o, contextlib.nullcontext, None)
    assert calls == [16, 48]  # the CPU estimate (saved-tensor bytes) has no allocator state


def test_probe_slope_is_at_least_the_held_graphs(monkeypatch):
    """Small probe chunks may peak at the end of their backward (parameter gradients), not when it
    starts (every saved activation): the peak line through them then rises slower than the held
    activations, and extrapolated to a large chunk it under-counts (an H200 plan for 16 GiB peaked
    at 16.6). Simulated: peak 300 + 5/row, held 10/row: the planned slope must be 10, and the line
    must stay above both measured peaks."""
    from bigbatch.gradcache import budget

    def fake_measure(model, x, get_rep, autocast_ctx, params, device, by_grad=True):
        rows = x.shape[0]
        return 300.0 + 5.0 * rows, 10.0 * rows, 8.0 * rows

    monkeypatch.setattr(budget, "_measure", fake_measure)
    cost = budget.ChunkProber().cost(nn.Linear(6, 8), torch.zeros(100, 6), lambda o: o, contextlib.nullcontext, None)
    assert cost.per_row == 10.0
    for rows in (16, 48):
        assert cost.peak(rows) >= 300.0 + 5.0 * rows
    assert cost.largest_chunk(int(cost.peak(40)), 100) == 40


def test_the_plan_counts_the_grad_tensors_the_step_creates():
    """After ``zero_grad()`` (``.grad`` None) the step creates every ``.grad``, held beside each
    later chunk's new gradients: the plan counts those bytes, once per shared parameter, and only
    for parameters that are trained and have no ``.grad`` yet."""
    from bigbatch.gradcache.budget import in_use_at_start

    shared = nn.Linear(64, 64)
    q_enc, p_enc = nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Linear(64, 32))
    frozen = p_enc[1].bias.requires_grad_(False)
    cpu = [torch.device("cpu")]
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)
    assert in_use_at_start(cpu, [q_enc, p_enc]) == nbytes(shared.weight, shared.bias, p_enc[1].weight)
    shared.weight.grad = torch.zeros_like(shared.weight)
    assert in_use_at_start(cpu, [q_enc, p_enc]) == nbytes(shared.bias, p_enc[1].weight)
    assert in_use_at_start([torch.device("meta")], [q_enc, p_enc]) == 0
    assert frozen.grad is None
    # a sparse embedding's .grad holds only the touched rows: its table is not counted
    bag = nn.Sequential(nn.EmbeddingBag(10_000, 16, sparse=True), nn.Linear(16, 8))
    assert in_use_at_start(cpu, [bag]) == nbytes(bag[1].weight, bag[1].bias)

    # a budget below the gradients the step creates: refused before anything runs
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 16)).double()
    x, y = torch.randn(512, 256, dtype=torch.float64), torch.randn(512, 256, dtype=torch.float64)
    g = nbytes(*model.parameters())
    with pytest.raises(ValueError, match=r"\.grad tensors the step creates"):
        GradCache(model, loss_fn=clip(), memory_budget=g // 2)(x, y)
    with pytest.raises(ValueError, match=r"\.grad tensors the step creates"):
        cached_encode(model, x, memory_budget=g // 2)
    # a budget that holds them: smaller chunks with .grad None than with every .grad already there
    gc = GradCache(model, loss_fn=clip(), memory_budget=3 * g)
    gc(x, y)
    with_none = gc.last_chunk_sizes
    gc(x, y)  # .grad now exists
    assert with_none[0] < gc.last_chunk_sizes[0] < 512, (with_none, gc.last_chunk_sizes)


def test_a_small_batch_is_probed_at_two_sizes():
    """A batch under the first probe size (16 rows) is still probed at two sizes: one point alone
    would charge the fixed part (the parameters' gradients) per row, so a smaller chunk's peak was
    under-counted and planned over budget."""
    from bigbatch.gradcache import budget

    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256)).double()
    params = list(model.parameters())
    for b in (2, 12, 16):
        x = torch.randn(b, 256, dtype=torch.float64)
        cost = budget.ChunkProber().cost(model, x, lambda o: o, contextlib.nullcontext, None)
        for c in (b // 2, b):
            measured = budget._measure(model, x[:c], lambda o: o, contextlib.nullcontext, params, torch.device("cpu"))[0]
            assert cost.peak(c) >= measured * (1 - 1e-9), (b, c, cost.peak(c), measured)


def test_the_fitted_line_stays_above_both_probes(monkeypatch):
    """Large weights, small activations: the slope floor (half the larger probe's bytes per row)
    must not pull the line below the smaller probe's measured peak."""
    from bigbatch.gradcache import budget

    monkeypatch.setattr(budget, "_measure", lambda model, x, *a, **k: (1000.0 + x.shape[0], 0.5 * x.shape[0], 8.0 * x.shape[0]))
    cost = budget.ChunkProber().cost(nn.Linear(6, 8), torch.zeros(100, 6), lambda o: o, contextlib.nullcontext, None)
    assert cost.peak(16) >= 1016.0 and cost.peak(48) >= 1048.0, (cost.fixed, cost.per_row)


def test_no_grad_encoding_is_not_charged_for_gradients():
    """cached_encode under no_grad runs no backward, so no .grad is created: a budget that holds the
    forward must not be refused for the weights' gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 32)).double()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(256, 256, dtype=torch.float64)
    with torch.no_grad():
        out = cached_encode(model, x, memory_budget=int(1.6 * weights))
        assert torch.allclose(out, model(x), rtol=1e-12, atol=1e-12)


def test_a_small_batch_probe_does_not_size_later_large_batches():
    """The cost probed on a 4-row batch (a line through 2 and 4 rows) is kept for that size only: a
    later large batch of the same shape is probed afresh and planned as by a fresh GradCache."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).double()

    big = [torch.randn(1024, 64, dtype=torch.float64) for _ in range(2)]
    budget = 4 * 2**20
    fresh = GradCache(make(), loss_fn=clip(), memory_budget=budget)
    fresh(*big)
    model = make()
    warm = GradCache(model, loss_fn=clip(), memory_budget=budget)
    warm(*[torch.randn(4, 64, dtype=torch.float64) for _ in range(2)])
    model.zero_grad(set_to_none=True)
    warm(*big)
    assert warm.last_chunk_sizes == fresh.last_chunk_sizes and fresh.last_chunk_sizes[0] < 1024


def test_the_cpu_probe_does_not_count_a_sparse_table_as_a_dense_gradient():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag, self.proj = nn.EmbeddingBag(100_000, 64, sparse=True), nn.Linear(64, 32)

        def forward(self, ids):
            return self.proj(self.bag(ids))

    torch.manual_seed(0)
    model, ids = Bag(), torch.randint(0, 100_000, (512, 8))
    table = model.bag.weight.numel() * model.bag.weight.element_size()
    cost = budget_mod().ChunkProber().cost(model, ids, lambda o: o, contextlib.nullcontext, None)
    assert cost.peak(64) < table / 10, (cost.fixed, cost.per_row, table)
    out = cached_encode(model, ids, memory_budget="4MiB")  # refused before: "too small for even one example"
    out.sum().backward()
    assert model.bag.weight.grad.is_sparse


def budget_mod():
    from bigbatch.gradcache import budget

    return budget
