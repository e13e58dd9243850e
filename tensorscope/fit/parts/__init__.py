"""The parts of a fit: each piece of ``ts.fit``'s work is an object with one attach/detach pair and
the step's events; ``Fit`` composes them in one declared order (handle.py, ``Fit._parts``).

# NOTE [fit as parts]
# A part (accelerate's ModelHook, torch's RemovableHandle, for a whole training step):
#   attach(model, optimizer)   install what it needs (hooks, routed forwards), once
#   detach()                   take all of it away again; the model and optimizer as they were,
#                              values current; idempotent
#   decide(decided)            a decision is in force (taken at a measured step's end, or
#                              again): apply it; False when it cannot (a write failed: the part
#                              says why, and the decision is taken again without it)
#   step_start(step)           the model's first training forward after the last step
#   forward_start/forward_end  each training forward of the model (forward_end: it returned)
#   step_end(step)             the user's optimizer.step() returned (None: no forward began a
#                              step), after the recorder's global step hook
#   abort(step)                an exception propagated out of the step (NOTE [an aborted step],
#                              abort.py): put the part's own state back to where the step
#                              began; return the parameters it updated that stay updated
#   stepping                   True while an optimizer.step() of the part's own runs (one
#                              parameter's update): not the user's step
# Fit dispatches attach, decide, step_start, forward_start, step_end in the declared order;
# detach, forward_end and abort in the reverse order (the last attached is the outermost: the
# recorder opens its recording after every other part prepared the step, and closes it first).
# A new part is one class here (a module of fit/parts/) and one line in Fit._parts.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tensorscope.checkpoint.offloaded import OffloadModel
    from tensorscope.fit.decide import Decision

__all__ = ["Decided", "Part", "Parts", "Step"]


@dataclass(frozen=True)
class Decided:
    """A decision as the parts apply it.

    Attributes:
        decision: the decision (decide.py).
        offload: what offloading each block's saved tensors moves and costs (None: offload
            was not a choice).
    """

    decision: Decision
    offload: OffloadModel | None = None


@dataclass(eq=False)
class Step:
    """The step in progress, as the parts see it.

    Attributes:
        number: 1 for the first step.
        measured: recorded as ``plan_before`` with every block checkpointed, gradients kept.
        recorded: recorded (``plan_before`` when measured, else ``plan_after``).
        batch_nbytes: bytes of the first forward's tensor inputs.
        grads_at_start: whether a gradient existed when it began.
        forwards: training forwards of the model so far.
        running: the frames of its forwards begun that have not returned (torch's call of the
            model's forward: on the stack while it runs).
        backwards: autograd graph tasks through the model's outputs begun, not finished.
        stepping: the frame of its ``optimizer.step()`` once that began, until it returns.
        started: ``time.perf_counter()`` at its first forward.
        thread: the thread of its first forward.
    """

    number: int
    measured: bool
    recorded: bool
    batch_nbytes: int
    grads_at_start: bool
    forwards: int = 0
    running: list[FrameType] = field(default_factory=list)
    backwards: set[int] = field(default_factory=set)
    stepping: FrameType | None = None
    started: float = field(default_factory=time.perf_counter)
    thread: int = field(default_factory=threading.get_ident)


class Part:
    """One piece of a fit's work (NOTE [fit as parts]); every event does nothing by default."""

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Install what the part needs on ``model`` and ``optimizer``."""

    def detach(self) -> None:
        """Take away everything the part installed (idempotent)."""

    def decide(self, decided: Decided) -> bool:
        """Apply ``decided``; False when the part cannot (the decision is taken again)."""
        return True

    def step_start(self, step: Step) -> None:
        """A step begins (before its first forward runs)."""

    def forward_start(self, step: Step) -> None:
        """A training forward of the model begins."""

    def forward_end(self, step: Step) -> None:
        """A training forward of the model returned."""

    def step_end(self, step: Step | None) -> None:
        """The user's ``optimizer.step()`` returned (``None``: outside a step)."""

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        """The step was aborted: the part's state as where it began. Returns the parameters
        the part updated in it that stay updated."""
        return ()

    @property
    def stepping(self) -> bool:
        """Whether an ``optimizer.step()`` of the part's own runs now."""
        return False


class Parts:
    """Parts in their declared order (NOTE [fit as parts])."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = tuple(parts)
        self._attached: list[Part] = []

    def __iter__(self) -> Iterator[Part]:
        return iter(self.parts)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Attach every part in order; if one raises, those attached are detached again."""
        try:
            for part in self.parts:
                part.attach(model, optimizer)
                self._attached.append(part)
        except BaseException:
            with contextlib.suppress(Exception):  # the attach's error is the one to see
                self.detach()
            raise

    def detach(self) -> None:
        """Detach the attached parts in reverse order (each one, whatever another raised)."""
        failed: BaseException | None = None
        while self._attached:
            try:
                self._attached.pop().detach()
            except BaseException as exc:  # the others are still given back
                failed = failed or exc
        if failed is not None:
            raise failed

    def decide(self, decided: Decided) -> bool:
        """Apply ``decided`` part by part; False at the first part that cannot."""
        return all(part.decide(decided) for part in self.parts)

    def step_start(self, step: Step) -> None:
        for part in self.parts:
            part.step_start(step)

    def forward_start(self, step: Step) -> None:
        for part in self.parts:
            part.forward_start(step)

    def forward_end(self, step: Step) -> None:
        for part in reversed(self.parts):
            part.forward_end(step)

    def step_end(self, step: Step | None) -> None:
        for part in self.parts:
            part.step_end(step)

    def abort(self, step: Step) -> list[torch.Tensor]:
        """Abort ``step`` in every part, in reverse order (each one, whatever another raised);
        the parameters they updated that stay updated."""
        updated: list[torch.Tensor] = []
        failed: BaseException | None = None
        for part in reversed(self.parts):
            try:
                updated += part.abort(step)
            except BaseException as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
        return updated

    @property
    def stepping(self) -> bool:
        """Whether a part's own ``optimizer.step()`` runs now (not the user's)."""
        return any(part.stepping for part in self.parts)
