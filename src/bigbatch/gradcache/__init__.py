"""Gradient caching: exact full-batch encoder gradients with memory set by a chunk.

* :class:`GradCache` -- one call runs a whole cached step (encode, loss, cached backward).
* :func:`cached_encode` -- the same as an autograd node, for loops you don't own.
* :mod:`.functional` -- ``cached`` / ``cat_input_tensor`` / ``gather_input_tensor``: the public
  GradCache's functional API for batches that arrive in sub-batches, with random and autocast state
  replayed (exact).
"""

from .budget import parse_memory
from .cache import GradCache
from .encode import cached_encode
from .functional import cached, cat_input_tensor, gather_input_tensor

__all__ = ["GradCache", "cached", "cached_encode", "cat_input_tensor", "gather_input_tensor", "parse_memory"]
