"""The recorder part: the measured step recorded as ``plan_before``, one step under the decision
as ``plan_after`` (``ts.record()``, docs/api.md §9).

# NOTE [the step boundary]
# A step begins at the model's first training forward (train() mode, grad enabled) after the
# previous optimizer step and ends when `optimizer.step()` returns (its step post-hook). The
# forward pre-hook is the model's own (with kwargs: the batch's bytes tell a larger batch), the
# post-hook a global one, filtered (ours, see _step_hooks.py: torch's dict of global step hooks
# is never mutated while another thread may be stepping); both are Fit's (handle.py). A
# recording opened in the pre-hook and closed in the post-hook registers no global hook there:
# the recorder's global hooks are installed once, when this part is attached (torch iterates
# its hook dicts while calling them). The step's blocks are found in the plan by module
# identity (`plan.module_ids`), which holds whichever module the recorder saw first as the root.
#
# NOTE [gradients seen as they are made]
# The recorder knows a `.grad` as a gradient when an op makes it inside AccumulateGrad or at the
# optimizer step's hooks; a gradient AccumulateGrad steals from its producer (the common case:
# no op runs) is known only at the step. Reads before the step (`clip_grad_norm_`, a
# GradScaler's `unscale_`) would not count as gradient readers, and freeing gradients at their
# update would change what they see. So while the measuring step is recorded, each parameter's
# post-accumulate-grad hook tells the recorder about its gradient at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tensorscope.errors import PlanError
from tensorscope.fit.inbackward import parameters_of
from tensorscope.fit.parts import Part, Step
from tensorscope.plan import hooks as plan_hooks
from tensorscope.plan.mode import recorder_here
from tensorscope.plan.model import MemoryPlan
from tensorscope.plan.record import Recording, record

__all__ = ["GlobalHooks", "StepRecorder"]


def _note_gradient(param: torch.Tensor) -> None:
    rec = recorder_here()
    if rec is not None:
        plan_hooks._note_parameter(rec, param)


class GlobalHooks:
    """The recorder's global hooks, held for a fit's life; ``remove()`` lets them go once."""

    def __init__(self) -> None:
        plan_hooks.install()
        self._held = True

    def remove(self) -> None:
        if self._held:
            self._held = False
            plan_hooks.uninstall()


class StepRecorder(Part):
    """Records the steps the fit measures (NOTE [the step boundary]).

    Attributes:
        plan: the plan of the last recorded step, once it ended (None: not recorded, or the
            user recorded that step themselves: ``ts.record()`` does not nest).
        opened_at: ``time.perf_counter()`` when the last recording opened (the parts' logs
            are lined up with its ops from there).
        hooks: the recorder's global hooks, from attach to detach.
    """

    def __init__(self) -> None:
        self.plan: MemoryPlan | None = None
        self.opened_at = 0.0
        self.hooks: GlobalHooks | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._recording: Recording | None = None
        self._grad_hooks: list[Any] = []

    @property
    def recording(self) -> bool:
        """Whether a recording is open."""
        return self._recording is not None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model, self._optimizer = model, optimizer
        self.hooks = GlobalHooks()  # before any recording opens in a hook

    def detach(self) -> None:
        self._discard()
        if self.hooks is not None:
            self.hooks.remove()

    def step_start(self, step: Step) -> None:
        self.plan = None
        if not step.recorded or self._model is None or self._optimizer is None:
            return
        self.opened_at = time.perf_counter()
        rec = record()
        try:
            rec.__enter__()
        except PlanError:  # the user records this step themselves: plan from a later one
            return
        self._recording = rec
        if step.measured:  # NOTE [gradients seen as they are made]
            self._grad_hooks = [
                p.register_post_accumulate_grad_hook(_note_gradient)  # type: ignore[no-untyped-call]
                for p in parameters_of(self._optimizer)
                if p.requires_grad
            ]
        # the recorder's own pre-hook ran before the model's, with no recording open; the
        # model's call is opened now, so that paths are the model's
        plan_hooks._before_forward(self._model, ())

    def step_end(self, step: Step | None) -> None:
        if step is None:
            return
        rec = self._discard()
        if rec is not None:
            try:
                self.plan = rec.plan()
            except PlanError:  # the step ran no op
                self.plan = None

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        self._discard()
        self.plan = None
        return ()

    def _discard(self) -> Recording | None:
        """Close the recording (if one is open); return it."""
        rec, self._recording = self._recording, None
        while self._grad_hooks:
            self._grad_hooks.pop().remove()
        if rec is not None:
            rec.__exit__(None, None, None)
        return rec
