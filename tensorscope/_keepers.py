"""Torch entry points that keep the tensors they are given as long-lived state.

``Optimizer.load_state_dict(state)`` keeps the loaded tensors as the optimizer's state (a no-op
``.to()`` returns them unchanged), and unpickling a module gives it the buffers pickle rebuilt
(``Module.__setstate__``). Made inside a scope (``torch.load`` there), those tensors would be owned
by it and die with it. These two entry points are wrapped (once, at the first scope) so that what
they keep leaves its scope: tensors that torch stores as state are never owned (docs/scopes.md).
The wrappers call torch's own method first and change nothing else.

Autograd graphs keep tensors through Python objects too, beyond what they save for backward
(which holds TensorImpls and needs nothing: ref.py's NOTE on disposal): a custom
``autograd.Function`` stores tensors on its ``ctx``, the reentrant ``torch.utils.checkpoint``
its function (a ``partial`` whose keywords hold tensors: HF Llama's ``position_embeddings``) and
RNG states there, and the non-reentrant checkpoint keeps the block's arguments in the closure
that recomputes it. Such refs leave their scopes when the graph takes them (after
``Function.apply``, and when a non-reentrant checkpoint starts): the graph holds them as long as
it lives, and they die with it, as in plain PyTorch.

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
import torch.utils.checkpoint
from torch import nn

from tensorscope._reach import tensors_in
from tensorscope._thread import CURRENT_SCOPE
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

    function_class: Any = torch.autograd.function.Function
    function_apply: Any = function_class.__dict__["apply"].__func__

    @functools.wraps(function_apply)  # keeps the name "apply": torch.compile recognises it
    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        out = function_apply(cls, *args, **kwargs)
        if CURRENT_SCOPE.get() is not None:
            _ctx_keeps(out)
        return out

    function_class.apply = classmethod(apply)

    checkpoint_module: Any = torch.utils.checkpoint
    without_reentrant: Any = checkpoint_module._checkpoint_without_reentrant_generator

    @functools.wraps(without_reentrant)
    def checkpoint_generator(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if CURRENT_SCOPE.get() is not None:
            _graph_keeps((fn, args, kwargs))
        return without_reentrant(fn, *args, **kwargs)

    checkpoint_module._checkpoint_without_reentrant_generator = checkpoint_generator


def _graph_keeps(value: Any) -> None:
    """Refs reachable from ``value`` (through partials and closures too) leave their scopes:
    an autograd graph reads them in backward."""
    for tensor in tensors_in(value, through_callables=True):
        if type(tensor) is TensorRef:
            tensor.detach_from_scope()


def _ctx_keeps(out: Any) -> None:
    """What the ``ctx`` of a custom Function's node holds (the node of its outputs)."""
    nodes: dict[int, Any] = {}
    for tensor in out if isinstance(out, (tuple, list)) else (out,):
        node = getattr(tensor, "grad_fn", None) if isinstance(tensor, torch.Tensor) else None
        attributes = getattr(node, "__dict__", None)
        if attributes:
            nodes[id(node)] = attributes
    for attributes in nodes.values():
        _graph_keeps(attributes)


def leave_scopes(value: Any) -> None:
    """Refs reachable from ``value`` leave their scopes (``detach_from_scope()``); a disposed
    one raises ``DisposedTensorError`` now."""
    for tensor in tensors_in(value):
        if type(tensor) is DisposedTensor:
            tensor.detach_from_scope()  # raises, naming the tensor
        elif type(tensor) is TensorRef:
            tensor.detach_from_scope()
