"""What a model's re-run must see again besides its random state and buffers: the modules'
train/eval modes and the parameters' values.

Between a chunk's first forward and its re-run there may be user code (``cached_encode`` returns
before the caller's backward; functional ``cached`` closures run later). A plain graph is
unaffected by ``model.eval()`` there (its backward does not look at modes) and raises when a saved
weight was modified in place; a re-run would silently take the eval path (no dropout) or use the
new weights. So the re-run runs under the modes of the first forward, and a parameter modified in
place in between is an error, as for a plain graph.

Cost per model and step: one walk over its modules and parameters when recorded, one read of
the parameters' version counters before pass 2 and before each re-run chunk (a few hundred
attribute reads for BERT-base; no device work).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Dict, Iterator, Optional, Tuple

from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from . import walk


_VERSION = operator.attrgetter("_version")
_TRAINING = operator.attrgetter("training")


def versioned_parameters(model: nn.Module) -> Tuple[Tensor, ...]:
    """``model``'s parameters that have a version counter (not inference tensors, nor lazy ones not
    materialised yet). Memoised with the structure (``walk.py``) unless a lazy one is among them:
    materialising changes its class, not its identity."""
    memo = walk.memoised("versioned parameters", model, _versioned_unless_lazy)
    return memo if memo is not None else tuple(filter(_versioned, walk.parameters(model)))


def _versioned_unless_lazy(model: nn.Module) -> Optional[Tuple[Tensor, ...]]:
    params = walk.parameters(model)
    return None if any(map(is_lazy, params)) else tuple(filter(_versioned, params))


def param_versions(model: nn.Module) -> Dict[int, int]:
    """``id(parameter) -> version`` of ``model``'s parameters (inference tensors have none)."""
    params = versioned_parameters(model)
    return dict(zip(map(id, params), map(_VERSION, params)))


def _versioned(p: Tensor) -> bool:
    """Has a version counter: not an inference tensor, nor a lazy parameter not materialised yet."""
    return not is_lazy(p) and not p.is_inference()


class ModelState:
    """The modes and parameter versions of ``model`` now (at the end of its first forward).

    ``before``: the versions when that forward began (:func:`param_versions`); a parameter the
    forward itself modified in place (weight clipping, an EMA update under ``no_grad``) is modified
    again by every forward, the re-run's included, so it is not checked. (Reads and checks are
    C-level maps over the memoised modules and parameters: no Python loop per parameter.)"""

    def __init__(self, model: nn.Module, before: Optional[Dict[int, int]] = None) -> None:
        self.model = model
        self.modules = walk.submodules(model)
        self.trainings = list(map(_TRAINING, self.modules))
        params = versioned_parameters(model)
        versions = list(map(_VERSION, params))
        if before is not None:  # (names are looked up only for an error)
            unchanged = list(map(operator.eq, map(before.get, map(id, params)), versions))
            params = tuple(itertools.compress(params, unchanged))
            versions = list(itertools.compress(versions, unchanged))
        self.params, self.versions = params, versions

    def check_params(self, what: str, during_backward: bool = False) -> None:
        """Raise if a parameter was modified in place since (``what``: the call that encoded);
        ``during_backward``: checked between the chunks of pass 2, where a hook may have written
        one (an optimizer step per parameter: the later chunks would re-run with the new weights)."""
        if list(map(_VERSION, self.params)) == self.versions:
            return
        changed = [p for p, v in zip(self.params, self.versions) if p._version != v]
        named = {id(p): n for n, p in self.model.named_parameters()}
        changed = [named.get(id(p), "(a parameter no longer registered)") for p in changed]
        names = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        if during_backward:
            raise RuntimeError(
                f"parameters of the encoder were modified in place during the cached backward ({names}), "
                "e.g. by an optimizer step in a post-accumulate-grad hook (optimizer-in-backward): each "
                "chunk's backward accumulates into .grad and the later chunks are re-run with the "
                "weights of the first forward, which must not change until every chunk is back-"
                "propagated: step the optimizer after the backward")
        raise RuntimeError(
            f"parameters of the encoder were modified in place after {what} and before the backward "
            f"({names}; e.g. an optimizer step): the chunks would be re-run with the new values, a "
            "gradient of another forward than the loss's (a plain graph raises where it saved such a "
            "weight): back-propagate first, then update the parameters. (Every parameter of the model "
            "is checked, also one its forward does not use: a logit scale that the loss clamps in place "
            "belongs outside the encoders, or is clamped after the backward.)")

    @contextlib.contextmanager
    def modes_restored(self) -> Iterator[None]:
        """Run the body with every module in the mode of the first forward (a ``model.eval()`` in
        between would make the re-run skip dropout); the modes of now are put back on exit."""
        now = list(map(_TRAINING, self.modules))
        differ = [] if now == self.trainings else [(m, was) for m, was, is_ in zip(self.modules, self.trainings, now)
                                                   if is_ != was]
        for m, was in differ:
            m.training = was
        try:
            yield
        finally:
            for m, was in differ:
                m.training = not was
