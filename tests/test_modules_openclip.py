"""ClipLoss / SigLipLoss take OpenCLIP's constructor arguments: the same losses and gradients
as the functional API with the matching group, in one process and over a real 2-process gloo group."""

from __future__ import annotations

import pickle

import pytest
import torch

import bigbatch

from distributed_harness import run_gloo


def _feats(b, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kw", [{}, {"local_loss": True, "gather_with_grad": True, "cache_labels": True},
                                {"rank": 0, "world_size": 1}])
def test_clip_constructor_arguments_one_process(kw):
    q, k = _feats(9, 5, 1).requires_grad_(), _feats(9, 5, 2)
    loss = bigbatch.ClipLoss(**kw, backend="torch")(q, k, 3.0)
    loss.backward()
    ref_q = q.detach().clone().requires_grad_()
    ref = bigbatch.clip_loss(ref_q, k, 3.0, backend="reference")
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-10) and torch.allclose(q.grad, ref_q.grad, rtol=1e-10)


@pytest.mark.parametrize("impl", [None, "bidir", "shift", "reduce", "gather"])
def test_siglip_constructor_arguments_one_process(impl):
    q, k = _feats(6, 4, 3), _feats(6, 4, 4)
    got = bigbatch.SigLipLoss(cache_labels=True, rank=0, world_size=1, dist_impl=impl, bidir=False)(q, k, 2.0, -1.0)
    assert torch.allclose(got, bigbatch.siglip_loss(q, k, 2.0, -1.0, backend="reference"), rtol=1e-10)


@pytest.mark.parametrize("cls,kw,needle", [
    (bigbatch.ClipLoss, {"use_horovod": True}, "use_horovod"),
    (bigbatch.SigLipLoss, {"use_horovod": True}, "use_horovod"),
    (bigbatch.ClipLoss, {"world_size": 2}, "init_process_group"),
    (bigbatch.ClipLoss, {"rank": 1}, "rank must be in"),
    (bigbatch.ClipLoss, {"rank": -1}, "rank must be a non-negative int"),
    (bigbatch.SigLipLoss, {"world_size": 0}, "world_size"),
    (bigbatch.SigLipLoss, {"dist_impl": "ring"}, "dist_impl must be one of"),
])
def test_bad_constructor_arguments_are_named(cls, kw, needle):
    with pytest.raises(ValueError, match=needle):
        cls(**kw)


def _two_ranks(rank, world):
    import torch.distributed as dist

    q, k = _feats(10, 5, 5), _feats(10, 5, 6)
    sl = slice(rank * 5, rank * 5 + 5)
    out = {}
    for name, make in (("openclip_args", lambda: bigbatch.ClipLoss(True, True, rank=rank, world_size=world)),
                       ("group", lambda: bigbatch.ClipLoss(group=dist.group.WORLD))):
        ql = q[sl].clone().requires_grad_()
        loss = make()(ql, k[sl], 3.0)
        loss.backward()
        out[name] = (loss.detach(), ql.grad)
    for name, make in (("sig_openclip_args", lambda: bigbatch.SigLipLoss(rank=rank, world_size=world, dist_impl="bidir")),
                       ("sig_group", lambda: bigbatch.SigLipLoss(group=dist.group.WORLD))):
        ql = q[sl].clone().requires_grad_()
        loss = make()(ql, k[sl], 2.0, -1.0)
        loss.backward()
        out[name] = (loss.detach(), ql.grad)
    try:
        bigbatch.ClipLoss(rank=1 - rank, world_size=world)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    # copies share the group, as OpenCLIP's modules copy (a ProcessGroup cannot be deep-copied)
    import copy
    import pickle

    ql = q[sl].clone().requires_grad_()
    original = bigbatch.ClipLoss(True, True, rank=rank, world_size=world)
    for how, clone in (("deepcopy", copy.deepcopy(original)), ("pickle", pickle.loads(pickle.dumps(original)))):
        out[how] = (clone._group() is dist.group.WORLD, torch.equal(clone(ql, k[sl], 3.0), out["openclip_args"][0]))
    return out


def test_rank_and_world_size_mean_the_default_group():
    res = run_gloo(_two_ranks, 2)
    q, k = _feats(10, 5, 5).requires_grad_(), _feats(10, 5, 6)
    ref = bigbatch.clip_loss(q, k, 3.0, backend="reference")
    ref.backward()
    for rank, out in enumerate(res):
        for a, b in (("openclip_args", "group"), ("sig_openclip_args", "sig_group")):
            assert torch.equal(out[a][0], out[b][0]) and torch.equal(out[a][1], out[b][1])
        # DDP averages over ranks: the averaged gradient of this rank's rows is the global one
        assert torch.allclose(out["openclip_args"][1], q.grad[rank * 5:rank * 5 + 5] * 2, rtol=1e-9)
        assert "do not match the process group" in out["mismatch"]
        assert out["deepcopy"] == (True, True) and out["pickle"] == (True, True)
    assert torch.allclose(sum(o["openclip_args"][0] for o in res) / 2, ref.detach(), rtol=1e-10)


def test_clip_forward_takes_openclip_logit_bias():
    """OpenCLIP's trainer calls loss(**model_out, output_dict=True) with logit_bias when the model has
    one: a constant bias changes no softmax loss or gradient; it joins the graph with gradient 0."""
    q, k = _feats(7, 5, 7).requires_grad_(), _feats(7, 5, 8)
    bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    ref = bigbatch.clip_loss(q.detach(), k, 3.0)
    out = bigbatch.ClipLoss()(image_features=q, text_features=k, logit_scale=3.0, logit_bias=bias, output_dict=True)
    assert set(out) == {"contrastive_loss"} and torch.allclose(out["contrastive_loss"], ref, rtol=1e-12)
    out["contrastive_loss"].backward()
    assert bias.grad is not None and bias.grad.item() == 0.0
    assert torch.is_tensor(bigbatch.ClipLoss()(q, k, 3.0, None))  # positional bias, no dict
    # a per-logit bias would change the loss (OpenCLIP adds it to the logits): refused, not ignored
    with pytest.raises(ValueError, match="logit_bias must be a scalar"):
        bigbatch.ClipLoss()(q, k, 3.0, torch.zeros(7))
    assert torch.isnan(bigbatch.ClipLoss()(q, k, 3.0, torch.tensor(float("nan"))))  # NaN in, NaN out, as there
    assert torch.isnan(bigbatch.ClipLoss()(q, k, 3.0, float("nan")))
    for bias in (2, 1.5, torch.tensor([[0.5]]), torch.tensor(3)):  # any one-number bias: the loss without it
        assert torch.allclose(bigbatch.ClipLoss()(q, k, 3.0, bias), ref, rtol=1e-12)
    with pytest.raises(ValueError, match="logit_bias must be on the features' device"):
        bigbatch.ClipLoss()(q, k, 3.0, torch.tensor(1.0, device="meta"))


def _pickled_for_the_default_group(rank, world):
    return pickle.dumps(bigbatch.ClipLoss(True, True, rank=rank, world_size=world))


def test_a_loss_pickled_for_the_default_group_needs_one_where_it_is_used():
    """Unpickled in a process without torch.distributed, it raises instead of silently computing
    a one-process loss."""
    blob = run_gloo(_pickled_for_the_default_group, 2)[1]
    loss = pickle.loads(blob)
    q = _feats(4, 5, 1)
    with pytest.raises(ValueError, match="pickled for the default process group"):
        loss(q, q, 3.0)


def _unpickled_in_another_world(rank, world, blob):
    loss = pickle.loads(blob)  # built on rank 1 of 2, used here on a group of one
    q = _feats(4, 5, 1)
    try:
        loss(q, q, 3.0)
    except ValueError as exc:
        return str(exc)
    return "ran"


def _copies_share_the_group(rank, world):
    import copy

    import torch.distributed as dist

    sub = dist.new_group([0, 1])
    out = []
    for group in (dist.group.WORLD, sub):
        c = copy.copy(bigbatch.ClipLoss(group=group))  # went through pickling: an error, or a string group
        out.append(c.group is group)
    return out


def test_an_unpickled_loss_checks_its_rank_and_world_size_and_copies_share_the_group():
    """A loss pickled on rank 1 of 2 ran silently on a group of one (the constructor refuses that);
    copy.copy of a loss bound to a group went through pickling: a misleading error for a sub-group,
    and the default group turned into its pickling marker string."""
    blob = run_gloo(_pickled_for_the_default_group, 2)[1]
    said = run_gloo(_unpickled_in_another_world, 1, blob)[0]
    assert "rank=1, world_size=2 do not match the process group (rank 0 of 1)" in said, said
    assert run_gloo(_copies_share_the_group, 2) == [[True, True], [True, True]]


def test_a_compiled_loss_module_pickles_and_its_copies_are_its_own():
    """After module.compile() (torch's in-place compile) pickling failed on the bound wrapper, and a
    deep copy kept calling the original module (its backend, its hooks)."""
    import copy

    loss = bigbatch.ClipLoss(backend="torch")
    loss.compile(backend="eager")
    q, k = _feats(5, 4, 1), _feats(5, 4, 2)
    want = bigbatch.clip_loss(q, k, 2.0, backend="reference")
    assert torch.allclose(pickle.loads(pickle.dumps(loss))(q, k, 2.0), want)
    twin = copy.deepcopy(loss)
    twin.backend = "no-such-backend"
    with pytest.raises(ValueError, match="backend must be one of"):
        twin(q, k, 2.0)
    assert torch.allclose(loss(q, k, 2.0), want)
