"""When a fitted step is aborted, and what is said about it. See NOTE [an aborted step].

# NOTE [an aborted step]
# An exception that propagates out of a fitted step's forward, backward or optimizer.step()
# aborts the step: every part puts its own state back to where the step began (the recording is
# closed and thrown away, a measuring chain run forgotten, blocks mapped in dropped, loss modes
# left, state read back written out again, gradients set aside given back) and the fit's phase
# goes back to where the step began (phase.py): fit's state is as if the step had not started,
# and nothing of another fit is touched. torch calls nothing when an exception leaves a
# backward or an optimizer step, so an abort is found by what did not happen:
#   - forward: the model's always_call forward hook runs for an Exception (at once); a
#     BaseException (KeyboardInterrupt) skips it: the forward stays begun-not-returned.
#   - backward: a hook on each of the model's outputs notes, when autograd reaches it, that a
#     backward through the step began, and queues an engine callback that notes its end; a
#     backward that raised after reaching the model never ends.
#   - optimizer.step(): the global step pre-hook notes its start, the post-hook its end.
# A forward or optimizer.step() begun and not ended may still be running (a fitted model called
# inside another's forward, a closure's forward inside optimizer.step()): the frame of its call
# is kept, and it is dead once that frame is off the stack. A step is checked at the model's
# next forward (any mode), its optimizer's next step, another fitted model's step starting on
# the same thread, explain() and remove() -- on the step's thread, never inside a backward (a
# forward there is a recomputation). That is when the abort happens, deterministically. A
# backward that raised before it reached the model's outputs (in the loss's own backward)
# changed nothing of the model and is not seen: the model's next forward counts as a second
# forward of the step.
# Updates that already ran cannot be taken back: optimizer-in-backward (fit/inbackward.py) and a
# kept-gradient step run one parameter at a time (statestore.py) update parameters before the
# step ends; they are named in a FitWarning. ts.fit(..., atomic=True) uses neither, so an
# aborted step leaves parameters and optimizer state as they were (docs/fit.md, "Aborted
# steps", for what that costs).
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any, Protocol

import torch
from torch import nn

from tensorscope._torch import graph_task_id
from tensorscope.errors import FitWarning
from tensorscope.fit.parts import Step
from tensorscope.plan.hooks import tensors_in

__all__ = ["OpenSteps", "dead", "running", "updated_words", "warn_updated", "watch_backward"]


def watch_backward(step: Step, output: Any) -> None:
    """Note in ``step.backwards`` each backward through ``output`` from when autograd reaches
    it until it has finished (NOTE [an aborted step])."""
    ref = weakref.ref(step)

    def reached(_: torch.Tensor) -> None:
        task = graph_task_id()
        found = ref()
        if found is None or task == -1 or task in found.backwards:
            return
        found.backwards.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: found.backwards.discard(task)
        )

    for tensor in tensors_in(output):
        if tensor.requires_grad and tensor.grad_fn is not None:
            tensor.register_hook(reached)  # type: ignore[no-untyped-call]


def running(frame: FrameType | None) -> bool:
    """Whether ``frame`` is on this thread's stack: its call has not returned."""
    here: FrameType | None = sys._getframe(1)
    while here is not None:
        if here is frame:
            return True
        here = here.f_back
    return False


def dead(step: Step) -> str | None:
    """What of ``step`` raised, when nothing of it can still be running; else None. Only on
    the step's thread (another thread cannot tell a running forward from a dead one)."""
    if threading.get_ident() != step.thread or graph_task_id() != -1:
        return None  # inside a backward: a forward now is a recomputation
    if not all(running(frame) for frame in step.running):
        return "forward"
    if step.backwards:
        return "backward"
    if step.stepping is not None and not running(step.stepping):
        return "optimizer.step()"
    return None


class _Aborts(Protocol):
    def _abort_if_dead(self) -> None: ...


class OpenSteps:
    """The fits with a step open, per thread: a step starting aborts the dead ones first."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _fits(self) -> weakref.WeakSet[Any]:
        fits: weakref.WeakSet[Any] | None = getattr(self._local, "fits", None)
        if fits is None:
            fits = self._local.fits = weakref.WeakSet()
        return fits

    def opened(self, fit: _Aborts) -> None:
        self._fits().add(fit)

    def closed(self, fit: _Aborts) -> None:
        self._fits().discard(fit)

    def abort_dead(self, but: _Aborts) -> None:
        """Abort the dead steps of this thread's other fits."""
        for fit in list(self._fits()):
            if fit is not but:
                fit._abort_if_dead()


def updated_words(
    model: nn.Module, params: Sequence[torch.Tensor], blocks: Sequence[nn.Module], path: str
) -> str:
    """``params`` named by where they live: the chain's blocks (``transformer.h.3``) and the
    other modules, with how many of each were updated.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> updated_words(net, [net[1].weight, net[1].bias, net[0].bias], [], "")
        '1 (2 parameters), 0 (1)'
    """
    where: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            where.setdefault(id(p), name or type(model).__name__)
    for k, block in enumerate(blocks):
        for p in block.parameters():
            where[id(p)] = f"{path}.{k}" if path else f"block {k}"
    counts: dict[str, int] = {}
    for p in params:
        key = where.get(id(p), "another module")
        counts[key] = counts.get(key, 0) + 1
    words = [f"{key} ({n})" for key, n in counts.items()]
    if words:
        first = next(iter(counts))
        words[0] = f"{first} ({counts[first]} parameter{'s' * (counts[first] != 1)})"
    return ", ".join(words)


def warn_updated(number: int, what: str, updated: Sequence[torch.Tensor], words: str) -> None:
    """The FitWarning of an aborted step that updated parameters (NOTE [an aborted step])."""
    warnings.warn(
        f"tensorscope.fit: step {number} was aborted (an exception propagated out of its "
        f"{what}) after {len(updated)} parameters were already updated in it: {words}. They "
        f"keep their new values and optimizer state; the others are as before the step. "
        f"ts.fit(..., atomic=True) keeps every step atomic (fit.explain() says at what cost).",
        FitWarning,
        stacklevel=4,
    )
