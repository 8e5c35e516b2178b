"""nn.Module wrappers with OpenCLIP's constructor and forward signatures."""

from __future__ import annotations

import copy
import numbers
from typing import Dict, Optional, Union

import torch
from torch import Tensor, nn

from .backends import BackendArg
from .functional import clip_loss, shared_local_errors

_SIGLIP_DIST_IMPLS = (None, "bidir", "shift", "reduce", "gather")


def openclip_group(group, rank: int, world_size: int, use_horovod: bool):
    """The process group an OpenCLIP-style ``(rank, world_size)`` pair means: ``group`` when given
    (checked against them), ``None`` for one process, else the default (WORLD) group, which must
    be initialised and match ``rank`` and ``world_size``."""
    if use_horovod:
        raise ValueError("use_horovod=True: bigbatch communicates through torch.distributed only "
                         "(pass group=<process group>, or rank/world_size of the initialised default group)")
    for name, v in (("rank", rank), ("world_size", world_size)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:  # numpy ints too
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    rank, world_size = int(rank), int(world_size)
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size) and world_size >= 1, got rank={rank}, world_size={world_size}")
    if group is None and world_size == 1:
        return None
    import torch.distributed as dist

    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"world_size={world_size} needs torch.distributed initialised (init_process_group) "
                             "or an explicit group=")
        group = dist.group.WORLD
    if world_size > 1 or rank > 0:  # given explicitly: they must describe the group
        got = (dist.get_rank(group), dist.get_world_size(group))
        if got != (rank, world_size):
            raise ValueError(f"rank={rank}, world_size={world_size} do not match the process group "
                             f"(rank {got[0]} of {got[1]})")
    return group


class _GroupLoss(nn.Module):
    """A loss module holding a process group (``self.group``): deep copies share the group (a
    ``ProcessGroup`` cannot be copied); pickling records the default group by name, so that it is
    the unpickling process's default group (another group cannot be pickled: a clear error)."""

    group = None
    # nn.Module's in-place compile (module.compile()) stores a wrapper bound to this instance: a copy
    # must not run the original's forward, and a bound wrapper cannot be pickled
    _NOT_COPIED = ("_compiled_call_impl",)

    def _copied(self) -> Dict:
        return {k: v for k, v in self.__dict__.items() if k not in self._NOT_COPIED}

    def __deepcopy__(self, memo):
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self._copied().items()})
        return new

    def __copy__(self):
        """A shallow copy sharing the group (``copy.copy`` would otherwise go through pickling)."""
        new = self.__class__.__new__(self.__class__)
        new.__dict__.update(self._copied())
        for k in ("_parameters", "_buffers", "_modules"):  # as nn.Module's own containers, not shared
            if k in new.__dict__:
                new.__dict__[k] = new.__dict__[k].copy()
        return new

    def __getstate__(self):
        state = super().__getstate__().copy()  # (nn.Module's own: drops the compiled wrapper)
        for k in self._NOT_COPIED:
            state.pop(k, None)
        if state.get("group") is not None and not isinstance(state["group"], str):  # (the marker already)
            import torch.distributed as dist

            if state["group"] is not dist.group.WORLD:
                raise TypeError(f"{type(self).__name__} bound to a process group other than the default one cannot "
                                "be pickled: build it again in the receiving process")
            state["group"] = _WORLD
        return state

    def _group(self):
        """The process group of a call: an unpickled module's default group is resolved here, in
        the process that uses it (an error if that process has none, as the constructor would)."""
        if isinstance(self.group, str) and self.group == _WORLD:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(f"this {type(self).__name__} was pickled for the default process group (world_size="
                                 f"{self.world_size}); initialise torch.distributed in this process first")
            # the rank / world size it was built with must still describe it (as the constructor checks;
            # None: a module of one process, bound to the default group all the same)
            return openclip_group(None, self.rank, self.world_size, False) or dist.group.WORLD
        return self.group


_WORLD = "<default process group>"


def _scalar_bias(bias):
    """OpenCLIP's ``logit_bias`` for the softmax loss: one number (a tensor of one element on any
    device and of any dtype, or anything ``float()`` takes), returned without a host sync; a bias
    of several elements (per logit) would change the loss and is refused."""
    if isinstance(bias, Tensor):
        if bias.numel() != 1:
            raise ValueError(f"logit_bias must be a scalar (one element), got shape {tuple(bias.shape)}")
        return bias.reshape(()).to(torch.float32) if not bias.is_floating_point() else bias.reshape(())
    try:
        return float(bias)
    except (TypeError, ValueError):
        raise TypeError(f"logit_bias must be a number or a one-element tensor, got {type(bias).__name__}") from None


class ClipLoss(_GroupLoss):
    """Drop-in for ``open_clip.ClipLoss``: the same constructor arguments and
    ``forward(image_features, text_features, logit_scale, logit_bias=None, output_dict=False)``.

    ``logit_scale`` is the multiplier (OpenCLIP passes ``model.logit_scale.exp()``).
    ``group`` (or OpenCLIP's ``rank``/``world_size`` of the initialised default group) makes the
    loss global over the ranks' shards, through bigbatch's ring: no feature gather, and the
    gradients averaged over ranks (DDP) are always the exact global ones -- OpenCLIP's
    ``gather_with_grad=True``, also when ``gather_with_grad=False`` is passed. Every rank returns the
    global loss (OpenCLIP's ``local_loss=False`` value) and back-propagates its share of it;
    ``local_loss`` and ``cache_labels`` change nothing here.
    ``use_horovod=True`` is refused.
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        group=None,
        backend: BackendArg = "auto",
    ) -> None:
        super().__init__()
        self.local_loss, self.gather_with_grad, self.cache_labels = local_loss, gather_with_grad, cache_labels
        self.rank, self.world_size = rank, world_size
        self.group = openclip_group(group, rank, world_size, use_horovod)
        self.backend = backend

    def forward(
        self, image_features: Tensor, text_features: Tensor, logit_scale, logit_bias=None, output_dict: bool = False
    ) -> Union[Tensor, Dict[str, Tensor]]:
        """``logit_bias`` (OpenCLIP's trainer passes it when the model has one; a scalar): a constant
        added to every logit changes neither the softmax loss nor any gradient, so it only joins the
        graph with its exact gradient, zero (DDP then sees it used, as with OpenCLIP; a NaN bias
        gives a NaN loss, as there). A per-logit bias would change the loss: refused."""
        group = self._group()
        bias = None
        if logit_bias is not None:  # checked before the ring: a rank raising alone would hang the others
            with shared_local_errors(group, "clip", image_features):
                bias = _scalar_bias(logit_bias)
                device = image_features.device if isinstance(image_features, Tensor) else None
                if isinstance(bias, Tensor) and device is not None and bias.device != device and bias.device.type != "cpu":
                    raise ValueError(f"logit_bias must be on the features' device {device} (or a CPU scalar), "
                                     f"got {bias.device}")
        loss = clip_loss(image_features, text_features, logit_scale, group=group, backend=self.backend)
        if bias is not None:
            loss = loss + (0.0 * bias.to(loss.dtype) if isinstance(bias, Tensor) else 0.0 * bias)
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(_GroupLoss):
    """Drop-in for ``open_clip.SigLipLoss``:
    ``forward(image_features, text_features, logit_scale, logit_bias=None, output_dict=False)``.

    ``logit_scale`` is the multiplier (OpenCLIP passes ``model.logit_scale.exp()``), ``logit_bias``
    the additive bias (``None``: 0). ``labels`` (keyword) are optional (B,) class ids: equal ids are
    positive pairs. ``group`` (or OpenCLIP's ``rank``/``world_size`` of the initialised default
    group) makes the loss global over the ranks' shards (a memory-bounded ring instead of OpenCLIP's
    neighbour exchange). Every rank returns the global loss (OpenCLIP's ranks return their own
    shares, whose mean it is) and back-propagates its share: gradients averaged over ranks (DDP)
    are the single-process ones. OpenCLIP's exchange
    variants (``dist_impl``, ``bidir``) all compute this same loss; ``use_horovod=True`` is refused.
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: Optional[str] = None,
        bidir: bool = True,
        use_horovod: bool = False,
        *,
        group=None,
        backend: BackendArg = "auto",
    ) -> None:
        super().__init__()
        if dist_impl not in _SIGLIP_DIST_IMPLS:
            raise ValueError(f"dist_impl must be one of {_SIGLIP_DIST_IMPLS}, got {dist_impl!r}")
        self.cache_labels, self.rank, self.world_size, self.dist_impl, self.bidir = cache_labels, rank, world_size, dist_impl, bidir
        self.group = openclip_group(group, rank, world_size, use_horovod)
        self.backend = backend

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale,
        logit_bias=None,
        output_dict: bool = False,
        *,
        labels=None,
    ) -> Union[Tensor, Dict[str, Tensor]]:
        from .functional import siglip_loss

        bias = 0.0 if logit_bias is None else logit_bias
        loss = siglip_loss(
            image_features, text_features, logit_scale, bias, labels=labels, group=self._group(), backend=self.backend
        )
        return {"contrastive_loss": loss} if output_dict else loss
