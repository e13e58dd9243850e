"""torch.optim's global step hooks: optimizer steps run without the mode, and a step that
raised half-way through creating its state does not break the next one.

# NOTE [optimizer steps run without the mode]
# Nothing an optimizer step creates is owned (that is where optimizer state is born), so the
# mode is popped for the step (the global step pre-hook) and pushed back by the post-hook: a
# single-tensor Adam step is half the ops of a small training step, and each would pay the
# mode's cost for nothing. With the residency manager active on the thread the mode stays (the
# step's operands must be resident) and the record_function region torch.optim opens around the
# step keeps its results unowned. A step that raises skips the post-hook; the next scope event
# or step of the thread puts the mode back.
#
# NOTE [a failed step leaves the optimizer usable]
# Adam-like optimizers create a parameter's whole state (``step``, ``exp_avg``, ...) before any
# update, one tensor at a time. If that raises half-way (a full disk under the residency
# manager), the parameter's state is left half made, and every later step fails on the missing
# key. So the pre-hook remembers which parameters had no state; if the step does not reach the
# post-hook, the next step of that optimizer first empties the states those parameters got,
# and they are made afresh: the retried step computes exactly what the first would have.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from tensorscope._slot import active_residency
from tensorscope._thread import thread_state

__all__ = ["install_hooks"]

# optimizer -> the parameters that had no state when its step began (while the step runs)
_stateless_before: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _stateless_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optimizer.state
    return [p for group in optimizer.param_groups for p in group["params"] if not state.get(p)]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    failed = _stateless_before.pop(optimizer, None)
    if failed:
        for param in failed:  # the previous step raised before its post-hook
            if optimizer.state.get(param):
                optimizer.state[param] = {}
    _stateless_before[optimizer] = _stateless_params(optimizer)
    state = thread_state()
    state.resume()  # the previous step raised and the exception was caught
    # Nothing a step makes is owned; the residency manager keeps the mode for its operands.
    state.pop_for("optimizer", keep_mode=active_residency() is not None)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _stateless_before.pop(optimizer, None)
    try:
        manager = active_residency()
        if manager is not None:
            manager.iteration_boundary()  # may raise (a sharded parameter it cannot manage)
    finally:
        state = thread_state()
        if state.popped_for == "optimizer":
            state.resume(step_completed=True)


def install_hooks() -> list[Any]:
    """Register the global pre/post step hooks; returns their handles."""
    return [
        register_optimizer_step_pre_hook(_before_step),
        register_optimizer_step_post_hook(_after_step),
    ]
