"""Torch entry points that keep the tensors they are given as long-lived state.

``Optimizer.load_state_dict(state)`` keeps the loaded tensors as the optimizer's state (a no-op
``.to()`` returns them unchanged), and unpickling a module gives it the buffers pickle rebuilt
(``Module.__setstate__``). Made inside a scope (``torch.load`` there), those tensors would be owned
by it and die with it. These two entry points are wrapped (once, at the first scope) so that what
they keep leaves its scope: tensors that torch stores as state are never owned (docs/scopes.md).
The wrappers call torch's own method first and change nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tensorscope.ref import unown

__all__ = ["install"]

_installed: list[bool] = []


def _optimizer_state(optimizer: torch.optim.Optimizer) -> Iterator[object]:
    for state in optimizer.state.values():
        yield from state.values()


def install() -> None:
    """Wrap the two entry points (idempotent)."""
    if _installed:
        return
    _installed.append(True)
    load_state_dict: Any = torch.optim.Optimizer.load_state_dict
    setstate: Any = nn.Module.__setstate__

    @functools.wraps(load_state_dict)
    def optimizer_load_state_dict(self: torch.optim.Optimizer, state_dict: Any) -> None:
        load_state_dict(self, state_dict)
        unown(_optimizer_state(self))

    @functools.wraps(setstate)
    def module_setstate(self: nn.Module, state: Any) -> None:
        setstate(self, state)
        unown(self.__dict__.get("_buffers", {}).values())

    torch.optim.Optimizer.load_state_dict = optimizer_load_state_dict  # type: ignore[method-assign]
    nn.Module.__setstate__ = module_setstate  # type: ignore[method-assign]
