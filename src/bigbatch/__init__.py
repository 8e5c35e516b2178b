"""bigbatch: exact contrastive learning at any batch size in constant memory."""

from .functional import clip_loss, infonce_loss, siglip_loss
from .modules import ClipLoss, SigLipLoss

__version__ = "0.1.0"

__all__ = ["ClipLoss", "SigLipLoss", "siglip_loss", "clip_loss", "infonce_loss", "__version__"]
