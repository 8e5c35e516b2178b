"""Exact contrastive losses over a global batch sharded across ranks of a process group.

* :func:`ring_clip_loss`, :func:`ring_infonce_loss` -- what ``bigbatch.clip_loss`` /
  ``bigbatch.infonce_loss`` call when given ``group=``: a ring of key blocks over
  ``torch.distributed`` (tile backends) or gather-with-grad (``backend="reference"``).
* :func:`ring_siglip_loss` -- what ``bigbatch.siglip_loss`` calls when given ``group=`` (text
  blocks around the ring; ``chunk_rows=`` forces its chunk size).
* :mod:`bigbatch.distributed.ring` -- the reusable communication primitives
  (:class:`Ring`, :func:`agree`, :func:`offsets`) for other ring losses.

See ``docs/ring.md`` for the design and its cost model.
"""

from .gather import gather_with_grad
from .losses import raise_on_every_rank, ring_clip_loss, ring_infonce_loss
from .ring import Pending, Ring, agree, dtype_code, offsets
from .sigmoid import ring_siglip_loss

__all__ = [
    "Pending",
    "Ring",
    "agree",
    "dtype_code",
    "gather_with_grad",
    "offsets",
    "raise_on_every_rank",
    "ring_clip_loss",
    "ring_infonce_loss",
    "ring_siglip_loss",
]
