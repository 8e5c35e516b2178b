"""nn.Module wrappers with OpenCLIP's forward signatures."""

from __future__ import annotations

from typing import Dict, Union

from torch import Tensor, nn

from .backends import BackendArg
from .functional import clip_loss


class ClipLoss(nn.Module):
    """Drop-in for ``open_clip.ClipLoss``: ``forward(image_features, text_features, logit_scale, output_dict=False)``.

    ``logit_scale`` is the multiplier (OpenCLIP passes ``model.logit_scale.exp()``).
    ``group`` makes the loss global over a process group's shards (the ring).
    """

    def __init__(self, *, group=None, backend: BackendArg = "auto") -> None:
        super().__init__()
        self.group = group
        self.backend = backend

    def forward(
        self, image_features: Tensor, text_features: Tensor, logit_scale, output_dict: bool = False
    ) -> Union[Tensor, Dict[str, Tensor]]:
        loss = clip_loss(image_features, text_features, logit_scale, group=self.group, backend=self.backend)
        return {"contrastive_loss": loss} if output_dict else loss


class SigLipLoss(nn.Module):
    """Drop-in for ``open_clip.SigLipLoss``:
    ``forward(image_features, text_features, logit_scale, logit_bias=None, output_dict=False)``.

    ``logit_scale`` is the multiplier (OpenCLIP passes ``model.logit_scale.exp()``), ``logit_bias``
    the additive bias (``None``: 0). ``labels`` (keyword) are optional (B,) class ids: equal ids are
    positive pairs. ``group`` makes the loss global over a process group's shards (a memory-bounded
    ring instead of OpenCLIP's neighbour exchange); the value per rank follows OpenCLIP's convention.
    """

    def __init__(self, *, group=None, backend="auto") -> None:
        super().__init__()
        self.group = group
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
            image_features, text_features, logit_scale, bias, labels=labels, group=self.group, backend=self.backend
        )
        return {"contrastive_loss": loss} if output_dict else loss
