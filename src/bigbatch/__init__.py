"""bigbatch: exact contrastive learning at any batch size in constant memory."""

from .functional import clip_loss, infonce_loss, siglip_loss
from .modules import ClipLoss, SigLipLoss
from .gradcache import GradCache, cached_encode

__version__ = "0.1.0"

__all__ = ["GradCache", "cached_encode", "ClipLoss", "SigLipLoss", "siglip_loss", "clip_loss", "infonce_loss", "__version__"]
