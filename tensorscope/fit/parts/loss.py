"""The loss routing part: a large plain ``F.cross_entropy`` in the model's training forward runs
with its gradient in place (NOTE [the loss's gradient in place], fit/loss.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from tensorscope.fit.loss import LossMode
from tensorscope.fit.parts import Part, Step

__all__ = ["LossRouting"]


def _leave(mode: LossMode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack, also from under modes pushed
    after it (a forward that did not return left them)."""
    above: list[object] = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


class LossRouting(Part):
    """Enters a ``LossMode`` (thread-local) for each training forward of the model, leaves it
    when the forward returns.

    Attributes:
        routed: cross-entropy calls routed so far.
        shape: the last routed logits' shape.
    """

    def __init__(self) -> None:
        self.routed = 0
        self.shape: tuple[int, ...] = ()
        self._local = threading.local()

    def _stack(self) -> list[LossMode | None]:
        stack: list[LossMode | None] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def forward_start(self, step: Step) -> None:
        mode = None
        if not torch.compiler.is_compiling():  # no routing while Dynamo traces
            mode = LossMode()
            mode.__enter__()  # type: ignore[no-untyped-call]
        self._stack().append(mode)

    def forward_end(self, step: Step) -> None:
        stack = self._stack()
        mode = stack.pop() if stack else None
        if mode is None:
            return
        mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        if mode.routed:
            self.routed += mode.routed
            self.shape = mode.shape

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        stack = self._stack()  # forwards that did not return (KeyboardInterrupt) left theirs
        while stack:
            mode = stack.pop()
            if mode is not None:
                _leave(mode)
        return ()

    def detach(self) -> None:
        stack = self._stack()
        while stack:
            mode = stack.pop()
            if mode is not None:
                _leave(mode)
