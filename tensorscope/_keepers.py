"""Torch entry points that keep the tensors they are given as long-lived state.

``Optimizer.load_state_dict(state)`` keeps the loaded tensors as the optimizer's state (a no-op
``.to()`` returns them unchanged), and unpickling a module gives it the buffers pickle rebuilt
(``Module.__setstate__``). Made inside a scope (``torch.load`` there), those tensors would be owned
by it and die with it. These two entry points are wrapped (once, at the first scope) so that what
they keep leaves its scope: tensors that torch stores as state are never owned (docs/scopes.md).
The wrappers call torch's own method first and change nothing else.

``multiprocessing.Queue.put(obj)`` keeps ``obj`` too: its feeder thread pickles it later, when
the scope that made a tensor in it may have disposed it (the item was dropped and ``get()`` in
the consumer blocked forever). A ref put on such a queue leaves its scope (it is the queue's now,
until pickled: torch's reductions share its storage with the consumer); a disposed one raises at
``put()``.
"""

from __future__ import annotations

import functools
import multiprocessing.queues
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tensorscope._reach import tensors_in
from tensorscope.ref import DisposedTensor, TensorRef, unown

__all__ = ["install", "leave_scopes"]

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

    queue_put: Any = multiprocessing.queues.Queue.put

    @functools.wraps(queue_put)
    def put(self: Any, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        leave_scopes(obj)
        queue_put(self, obj, block, timeout)

    multiprocessing.queues.Queue.put = put  # type: ignore[method-assign]


def leave_scopes(value: Any) -> None:
    """Refs reachable from ``value`` leave their scopes (``detach_from_scope()``); a disposed
    one raises ``DisposedTensorError`` now."""
    for tensor in tensors_in(value):
        if type(tensor) is DisposedTensor:
            tensor.detach_from_scope()  # raises, naming the tensor
        elif type(tensor) is TensorRef:
            tensor.detach_from_scope()
