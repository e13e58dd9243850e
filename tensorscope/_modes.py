"""The base of every torch mode of tensorscope: how our modes meet torch.compile, said once.

``DispatchMode`` (a ``TorchDispatchMode``: the residency Interceptor, the recorder's PlanMode,
rotor's StorageTracker) and ``FunctionMode`` (a ``TorchFunctionMode``: ts.fit's LossMode)
derive from ``Mode``, which holds the class attributes torch and dynamo read;
tests/core/test_modes.py checks that every mode of the package derives from it and that no
mode sets one of them itself.

# NOTE [our modes and torch.compile]
# - ``_should_skip_dynamo() -> False``: torch would otherwise wrap ``__torch_dispatch__`` in a
#   dynamo-disabling shim (it imports torch._dynamo, seconds, and costs ~1 µs per op:
#   docs/design.md §1). Dynamo is told instead to skip our handlers' code objects
#   (``skip_in_dynamo``): its frame callback then runs them as they are, at no cost. A
#   subclass's ``__torch_dispatch__`` is skipped when the class is made.
# - ``ignore_compile_internals() -> True`` unless the class sets ``eager_under_compile``:
#   torch.compile then compiles user code with the mode on the stack (off while it compiles, on
#   while the compiled code runs; outputs of compiled graphs are seen through _compiled.py).
#   A mode that must see every op eagerly (StorageTracker counts the bytes of the storages ops
#   return; an inductor kernel allocates its outputs below the dispatcher, unseen: a compiled
#   function counted 0 bytes where eager counts its 12 kB) sets ``eager_under_compile = True``,
#   and dynamo then runs the frames under it eagerly.
# - ``supports_higher_order_operators = False``: our handlers take ``OpOverload``s (their
#   schema: the op table); a higher-order operator run eagerly under one of our modes raises
#   torch's NotImplementedError naming the mode, as before this class existed.
# A ``TorchFunctionMode`` has no such switches in torch 2.13 (dynamo traces its
# ``__torch_function__`` into the graph), so ``FunctionMode`` only carries the base.

Layer 3: imports torch only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchMode", "FunctionMode", "Mode", "skip_in_dynamo"]


def skip_in_dynamo(*functions: Any) -> None:
    """Tell torch.compile never to compile these frames (tensorscope's per-op and hook code is
    not the user's): dynamo's frame callback then runs them as they are, at no cost (what
    ``torch._dynamo.skip_code`` does, without importing torch._dynamo)."""
    try:
        frames: Any = torch._C._dynamo.eval_frame
        skip = frames._FrameExecStrategy(frames._FrameAction.SKIP, frames._FrameAction.DEFAULT)
    except AttributeError:  # pragma: no cover - an older or newer torch
        return
    for function in functions:
        frames.set_code_exec_strategy(function.__code__, skip)


class Mode:
    """What every mode of tensorscope says to torch and dynamo (see the NOTE)."""

    #: True: torch.compile runs eagerly while the mode is pushed (it must see every op).
    eager_under_compile: ClassVar[bool] = False
    supports_higher_order_operators: ClassVar[bool] = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return not cls.eager_under_compile


class DispatchMode(Mode, TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The base of tensorscope's ``TorchDispatchMode``s."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]
        handler = cls.__dict__.get("__torch_dispatch__")
        if handler is not None and hasattr(handler, "__code__"):
            skip_in_dynamo(handler)


class FunctionMode(Mode, TorchFunctionMode):
    """The base of tensorscope's ``TorchFunctionMode``s."""
