"""The public GradCache's spellings work here too: ``fp16=True`` with a scaler, and the call
keyword ``no_sync_except_last`` (a step option, never passed on to ``loss_fn``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bigbatch
from bigbatch.gradcache import GradCache

from helpers import assert_rel


def _encoder(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def _loss(q, p):  # no **kwargs: an unexpected keyword would raise TypeError
    return bigbatch.clip_loss(q, p, 5.0, backend="torch")


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def test_fp16_flag_equals_fp16_autocast_with_scaler():
    x, y = torch.randn(12, 6), torch.randn(12, 6)
    results = []
    for kwargs in ({"fp16": True}, {"autocast_dtype": torch.float16}):
        model = _encoder(0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        GradCache([model], chunk_sizes=5, loss_fn=_loss, scaler=scaler, **kwargs)(x, y)
        results.append(_grads(model))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_fp16_flag_needs_a_scaler_and_fp16():
    with pytest.raises(ValueError, match="needs scaler"):
        GradCache([_encoder(0)], chunk_sizes=4, loss_fn=_loss, fp16=True)
    with pytest.raises(ValueError, match="fp16=True means"):
        GradCache([_encoder(0)], chunk_sizes=4, loss_fn=_loss, fp16=True, autocast_dtype=torch.bfloat16,
                  scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("flag", [True, False])
def test_no_sync_except_last_is_a_step_option(flag):
    x, y = torch.randn(10, 6), torch.randn(10, 6)
    model = _encoder(1)
    GradCache([model], chunk_sizes=3, loss_fn=_loss)(x, y, no_sync_except_last=flag)
    got = _grads(model)
    ref_model = _encoder(1)
    _loss(ref_model(x), ref_model(y)).backward()
    for g, r in zip(got, _grads(ref_model)):
        assert_rel(g, r, 1e-5, "grad")


@pytest.mark.parametrize("rows", [12, 11, 9])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_same_gradients_as_the_public_gradcache(dropout, rows):
    """The public GradCache (PyPI gradcache 0.0.1, unmodified) as an oracle: same models, chunk
    size and seed give the same loss and gradients (its class API replays random state too), also
    where the batch is not a multiple of the chunk: both cut the short chunk last, so dropout draws
    the same masks (bigbatch keeps the last chunk's graph, the public package re-runs it)."""
    from bigbatch.bench.gradcache import load_public_gradcache

    public_cls, note = load_public_gradcache()
    assert public_cls is not None, note
    torch.manual_seed(0)

    def model():
        # two dropout layers: each chunk draws layer 1's masks, then layer 2's, so the masks depend
        # on where the chunks are cut (with one layer the stream would be read in row order anyway)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.LayerNorm(16), nn.Linear(16, 16),
                             nn.Dropout(dropout), nn.Linear(16, 8)).double()

    def loss_fn(q, p, scale=5.0):
        return bigbatch.clip_loss(q, p, scale, backend="reference")

    x, y = torch.randn(rows, 6, dtype=torch.float64), torch.randn(rows, 6, dtype=torch.float64)
    results = []
    for make in (lambda ms: public_cls(ms, 4, loss_fn=loss_fn), lambda ms: GradCache(ms, chunk_sizes=4, loss_fn=loss_fn)):
        torch.manual_seed(1)
        ms = [model(), model()]
        torch.manual_seed(2)
        loss = make(ms)(x, y, scale=7.0)
        results.append((loss.detach(), [p.grad.clone() for m in ms for p in m.parameters()]))
    (l_pub, g_pub), (l_ours, g_ours) = results
    assert abs(l_pub.item() - l_ours.item()) <= 1e-12 * abs(l_pub.item())
    for a, b in zip(g_ours, g_pub):
        assert_rel(a, b, 1e-10, "grad vs the public GradCache")


def _gather_worker(rank: int, world: int):
    from bigbatch.gradcache import gather_input_tensor

    g = torch.Generator().manual_seed(0)
    sizes = [3, 5]
    q, k = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)
    sl = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    ql, kl = q[sl].clone().requires_grad_(), k[sl].clone().requires_grad_()
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)  # a learned temperature

    @gather_input_tensor
    def loss_fn(a, b, *, offset):
        return bigbatch.clip_loss(a, b, scale + offset)

    loss = loss_fn(ql, kl, offset=0.0) * world  # x world: DDP's averaging then gives the full gradient
    loss.backward()
    columns = gather_input_tensor(lambda a: a, axis=1)(q[sl].T.contiguous())  # another axis
    assert torch.equal(columns, q.T)
    # the loss's own parameter saw the whole batch: its gradient / world, no all-reduce (the docs)
    return loss.detach() / world, ql.grad, kl.grad, scale.grad / world


def test_gather_input_tensor_uneven_ranks():
    """The public package's distributed decorator: every rank's loss sees the global batch (sizes
    may differ), only its own rows carry gradient."""
    from distributed_harness import run_gloo

    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 4, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(8, 4, generator=g, dtype=torch.float64).requires_grad_()
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    ref = bigbatch.clip_loss(q, k, scale)
    ref.backward()
    out = run_gloo(_gather_worker, 2)
    rows = [slice(0, 3), slice(3, 8)]
    for (loss, gq, gk, gs), sl in zip(out, rows):
        assert torch.allclose(loss, ref.detach(), rtol=1e-12)
        assert torch.allclose(gs, scale.grad, rtol=1e-12)  # exact on every rank, averaged or not
        # the loss x world gives each rank's rows world x their full-batch gradient, which DDP's
        # averaging of the parameter gradients divides back
        assert torch.allclose(gq, 2 * q.grad[sl], rtol=1e-10) and torch.allclose(gk, 2 * k.grad[sl], rtol=1e-10)


def test_public_constructor_positions_and_attributes():
    """(models, chunk_sizes, loss_fn, split_input_fn, get_rep_fn, fp16, scaler) by position, as the
    public package; chunk_sizes kept one per model; get_rep_fn None by default; the loss keeps its shape."""
    a, b = nn.Linear(3, 4).double(), nn.Linear(3, 4).double()
    gc = GradCache([a, b], 2, lambda q, p: (q * p).sum().reshape(1), None, None, False, None)
    assert gc.chunk_sizes == [2, 2] and gc.get_rep_fn is None and gc.fp16 is False
    gc.chunk_sizes[1] = 3
    x = torch.randn(5, 3, dtype=torch.float64)
    loss = gc(x, x)
    assert loss.shape == (1,) and gc.last_chunk_rows == [[2, 2, 1], [3, 2]]


def test_subclass_hook_overrides_are_refused():
    """A public-GradCache subclass customises it by overriding methods that bigbatch never calls:
    refused with what to pass instead (before: silently ignored, wrong gradients)."""
    class Custom(GradCache):
        def get_reps(self, model_out):
            return model_out[:, 0]

    with pytest.raises(TypeError, match="overrides get_reps.*get_rep_fn="):
        Custom(nn.Linear(3, 4), 2, lambda q, p: (q * p).sum())


def test_an_input_the_builtin_split_cannot_cut_names_split_input_fn():
    class Obj:
        pass

    with pytest.raises(ValueError, match=r"inputs\[1\].*pass split_input_fn="):
        GradCache(nn.Linear(3, 4), 2, lambda q, p: (q * p).sum())(torch.randn(4, 3), Obj())


def test_gather_input_tensor_without_a_process_group_says_so():
    """It said "group was given", which the caller never did (session 12)."""
    import torch.distributed as dist

    from bigbatch.gradcache import gather_input_tensor

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="gather_input_tensor.*init_process_group"):
        gather_input_tensor(lambda a: a)(torch.ones(2, 3))


def _gather_mismatch_worker(rank: int, world: int):
    from bigbatch.gradcache import gather_input_tensor

    same = gather_input_tensor(lambda a: a)
    cases = {
        "width": torch.ones(2, 4 if rank == 0 else 5),
        "dtype": torch.ones(2, 4, dtype=torch.float32 if rank == 0 else torch.float64),
        "ndim": torch.ones(2, 4) if rank == 0 else torch.ones(2, 2, 2),
        "scalar": torch.tensor(2.0),
        "axis": torch.ones(3, 4) if rank == 0 else torch.ones(3),
    }
    out = {}
    for name, t in cases.items():
        fn = gather_input_tensor(lambda a: a, axis=1) if name == "axis" else same
        try:
            fn(t)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_gather_input_tensor_refuses_mismatched_tensors_on_every_rank():
    """Only the row counts were exchanged: another width or dtype was read as garbage bytes or killed a
    rank (gloo's EnforceNotMet), a 0-d tensor or a bad axis was an IndexError on one rank only."""
    from distributed_harness import run_gloo

    for out in run_gloo(_gather_mismatch_worker, 2, timeout=120.0):
        assert "the size of dimension 1 must be the same on every rank" in out["width"], out
        assert "the dtype must be the same on every rank" in out["dtype"] and "torch.float64" in out["dtype"], out
        assert "ndim must be the same on every rank" in out["ndim"], out
        assert "a 0-d tensor cannot be gathered" in out["scalar"], out
        assert "axis 1 is out of range for a tensor of shape (3,)" in out["axis"], out
