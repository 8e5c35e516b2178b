"""One autocast context per run of consecutive work on one model, across the passes of a step.

Autocast casts each fp32 weight to half precision once per *outermost* context (its weight-cast
cache lives until that context exits). A step with one context per pass and model casts every
weight of a model twice (pass 1, pass 2) where a plain step casts it once: ~150 cast launches
per BERT-base and pass, and on a host-bound step each launch is host time the GPU waits for.
:class:`CastScope` keeps the context of the model that ends pass 1 open through the loss and its
kept chunks' backward into that model's re-runs (which ``engine.rerun_groups`` puts first), and
one context across consecutive inputs of a shared model; so one model's weights are cast once
per step. Memory: no more than before -- the casts it keeps are the ones that model's kept graph
holds anyway, and a re-run context would re-create them. Since PyTorch's fix of its issue 158232
(PR 165068, merged December 2025) a cast autocast caches under ``no_grad`` keeps its graph to the fp32 weight,
so re-runs through it accumulate into the weight's ``.grad``. Before it (2.4 to at least 2.9) such a cast has
no graph and a later forward in grad mode in the same autocast region reuses it: the weight gets
no gradient. :func:`gradless_casts_cached` tells which torch runs; on an old one the scope is not
used, and :func:`drop_gradless_casts` empties the cache wherever grad-mode forwards follow no-grad
ones (a kept chunk, the re-runs -- also inside a caller's autocast region, for every API).
Gradients are bitwise those of one context per pass, except a parameter two encoders share (its
``.grad`` is summed in another order: the re-runs' order changed). ``tests/test_gradcache_cast_scope.py``.

Only ``GradCache`` (one call: pass 1, the loss, pass 2) uses a scope: ``cached_encode`` and
``cached`` return to the caller between the passes, where no context may be left open.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

# Off: one context per pass and model, as before (for the experiments' A/B; no test needs it off).
ENABLED = True


class CastScope:
    """The open autocast context (at most one), and the model it was opened for."""

    def __init__(self) -> None:
        self._stack: Optional[contextlib.ExitStack] = None
        self._model: Optional[nn.Module] = None
        self._device_type: Optional[str] = None

    @property
    def model(self) -> Optional[nn.Module]:
        """The model whose context is open (``None``: none is)."""
        return self._model

    @contextlib.contextmanager
    def around(self, model: nn.Module, device: torch.device, amp: Callable[[], Any]) -> Iterator[None]:
        """The body runs inside ``amp()`` opened for ``model`` on ``device``: the one already open
        when it is this model's, else a new one (the other model's closed first). Leaving the body
        leaves it open; :meth:`close` (or another model) ends it."""
        if self._stack is None or self._model is not model or self._device_type != device.type:
            self.close()
            stack = contextlib.ExitStack()
            stack.enter_context(amp())
            self._stack, self._model, self._device_type = stack, model, device.type
        yield

    def suspended(self) -> Any:
        """Autocast off inside the open context (a backward runs as it would outside it: its ops
        keep the dtypes of their forward); leaving it keeps the context's weight casts."""
        if self._stack is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device_type, enabled=False)

    def close(self) -> None:
        """Leave the open context (its weight casts are freed once no graph holds them)."""
        stack, self._stack, self._model, self._device_type = self._stack, None, None, None
        if stack is not None:
            stack.close()


@functools.lru_cache(maxsize=1)
def gradless_casts_cached() -> bool:
    """Whether this torch's autocast caches a weight cast made under ``no_grad`` without its graph
    and hands it to later grad-mode forwards of the same region (PyTorch before that fix). Asked once,
    of a 2 x 2 linear map on the CPU."""
    with torch.inference_mode(False), torch.enable_grad():
        w = torch.zeros(2, 2, requires_grad=True)  # (no random init: the caller's random state is untouched)
        x = torch.zeros(1, 2)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):  # (whatever the global setting)
            with torch.no_grad():
                torch.nn.functional.linear(x, w)
            y = torch.nn.functional.linear(x, w)
    return y.grad_fn is None


def drop_gradless_casts() -> None:
    """On a torch whose autocast caches graphless casts (:func:`gradless_casts_cached`), empty the
    cache before grad-mode forwards that follow no-grad ones: their weights are cast again, with
    their graph (a graph made earlier keeps its own casts). Elsewhere nothing."""
    if gradless_casts_cached():
        torch.clear_autocast_cache()
