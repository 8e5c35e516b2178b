"""A module given as ``get_rep_fn`` (a projection head; SimCLR's head with BatchNorm; a
``spectral_norm`` or lazy layer) runs as part of its model: ``WithHead(model, head)`` is the model
the engine sees, so the head's buffers, lazy initialisation, train/eval modes and parameter
versions are recorded, replayed and checked like the encoder's, and its parameters are the
model's (a head's state was not tracked before session 12: its BatchNorm statistics were updated
again by every re-run, a spectral norm's vectors read as pass 1 left them: 17-21% off).

A function given as ``get_rep_fn`` stays a function; a module reached only through its closure is
not tracked (its parameters still get exact gradients while it keeps no state).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from torch import nn


class WithHead(nn.Module):
    """``head(model(*args, **kwargs))``; built per step (cheap), identified by ``(model, head)``."""

    def __init__(self, model: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.head = head

    @property
    def bigbatch_encoder(self) -> nn.Module:
        """The module that takes the input (for error hints that read its signature)."""
        return self.model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.head(self.model(*args, **kwargs))


def attach_head(model: nn.Module, get_rep_fn: Optional[Callable[[Any], Any]]) -> Tuple[nn.Module, Optional[Callable]]:
    """``(model, get_rep_fn)`` as the engine runs them: a module ``get_rep_fn`` moved into the model."""
    if isinstance(get_rep_fn, nn.Module):
        return WithHead(model, get_rep_fn), None
    return model, get_rep_fn


def identity_of(model: nn.Module) -> Tuple[int, ...]:
    """What identifies ``model`` across steps (a ``WithHead`` is a new object every step)."""
    if isinstance(model, WithHead):
        return (id(model.model), id(model.head))
    return (id(model),)
