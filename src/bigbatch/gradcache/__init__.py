"""Gradient caching: exact full-batch encoder gradients with memory set by a chunk.

* :class:`GradCache` -- one call runs a whole cached step (encode, loss, cached backward).
* :func:`cached_encode` -- the same as an autograd node, for loops you don't own.
"""

from .budget import parse_memory
from .cache import GradCache
from .encode import cached_encode

__all__ = ["GradCache", "cached_encode", "parse_memory"]
