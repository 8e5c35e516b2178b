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
