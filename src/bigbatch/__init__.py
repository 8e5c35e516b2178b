"""bigbatch: exact contrastive learning at any batch size in constant memory."""

from .functional import clip_loss, infonce_loss
from .modules import ClipLoss

__version__ = "0.1.0"

__all__ = ["ClipLoss", "clip_loss", "infonce_loss", "__version__"]
