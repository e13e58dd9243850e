"""Aliases user code asks for: inside a scope, ``torch.ops.aten.alias``, ``torch.ops.aten.detach``
and ``torch.detach`` of a ref give a ref of the scope, as views do.

# NOTE [aliases user code asks for]
# ``detach`` and ``alias`` fall through the scope engines' dispatch key (_adopt.py's NOTE): C
# functions of torch (``nn.Parameter``'s ``_make_subclass``, ``as_subclass``, ``numpy()``) make
# subclasses or arrays from their results and need them without a Python object, and neither
# engine can tell their calls from a user's there. A user's call of the raw op comes through
# Python first: the op objects ``torch.ops.aten.alias`` / ``.default`` (and ``detach``'s) and
# the function ``torch.detach``. So those are where a user-requested alias of a ref becomes a
# ref (API §2: inside a scope, views and alias-like ops of refs are refs), by the rules of any
# op result (_adopt.py): owned by the innermost scope, plain where no scope owns results (no
# scope open, an optimizer step, a state maker's call), as a view of a ref is. (``ref.detach()``
# alone gives an unowned ref outside scopes, for ``nn.Parameter(ref)``: ref.py.) The op objects
# keep their identity (dispatch modes, FX graphs and decomposition tables hold them; their hash
# is the C op's): their class is switched to a subclass whose ``__call__`` runs torch's and
# then owns a plain result of a ref -- as ``torch.frombuffer`` is wrapped (_intercept.py),
# once, when the first scope or ``ts.manage`` opens. C++ callers of ``at::alias`` and
# ``at::detach`` never pass here, so torch's own uses and both engines' fast paths are as
# before. While torch.compile traces, nothing is owned (compiled graphs own their outputs:
# _compiled.py).

Layer 10: imports only layers 0-9.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket

from tensorscope._adopt import adopt
from tensorscope._thread import owning_scope, thread_state
from tensorscope.ref import TensorRef

__all__ = ["install"]

_OPS = ("alias", "detach")
_ORIGINAL_DETACH = torch.detach


def _owned(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    source = args[0] if args else kwargs.get("self")
    if (
        type(source) is TensorRef
        and type(out) is torch.Tensor
        and not torch.compiler.is_compiling()
    ):
        state = thread_state()
        scope = owning_scope(state)
        if scope is not None:
            adopt(out, scope, state.counters)
    return out


class _OwningPacket(OpOverloadPacket):
    """``torch.ops.aten.alias`` (and ``detach``) while installed (see the NOTE)."""

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return _owned(args, kwargs, OpOverloadPacket.__call__(self, *args, **kwargs))


class _OwningOverload(OpOverload):
    """``torch.ops.aten.alias.default`` (and ``detach``'s) while installed (see the NOTE)."""

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return _owned(args, kwargs, OpOverload.__call__(self, *args, **kwargs))


@functools.wraps(_ORIGINAL_DETACH)
def _detach(*args: Any, **kwargs: Any) -> Any:
    return _owned(args, kwargs, _ORIGINAL_DETACH(*args, **kwargs))


def install() -> None:
    """Switch the op objects' classes and wrap ``torch.detach`` (idempotent)."""
    for name in _OPS:
        packet = getattr(torch.ops.aten, name)
        if type(packet) is OpOverloadPacket:
            packet.__class__ = _OwningPacket
        overload = packet.default
        if type(overload) is OpOverload:
            overload.__class__ = _OwningOverload
    if torch.detach is _ORIGINAL_DETACH:
        torch.detach = _detach
