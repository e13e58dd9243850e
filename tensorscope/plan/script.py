"""``tensorscope plan script.py``: the memory plan of a script's training step, no code change.

# NOTE [the step boundary]
# A training script has no marker for "one step", but every step ends in ``optimizer.step()``.
# So a step is what runs between the end of one optimizer step and the end of the next, and
# the first one begins at the first forward of any ``nn.Module``. The command records the
# second step by default (``--iteration 2``): the first one also creates the optimizer's state
# and runs torch's first-call work, the second is what every later step looks like. A script
# that ends sooner is planned from the last step it completed. After the recorded step the
# script is stopped (``--run-to-end`` lets it finish). With ``--step module:function`` the
# script is run as a module (its ``if __name__ == "__main__":`` block does not run), then the
# function is called ``--warmup`` times and once more, recorded: it must take no arguments and
# run one step.
#
# The hooks that find the boundary (a global module forward pre-hook and an optimizer step
# post-hook) are registered once, before the script runs, around the recorder's own hooks, so
# a recording opens and closes inside a hook without registering anything there.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorscope import _step_hooks
from tensorscope.errors import InvalidArgumentError, PlanError
from tensorscope.plan import hooks
from tensorscope.plan.model import MemoryPlan
from tensorscope.plan.record import Recording, record

__all__ = ["StepRecorded", "plan_function", "plan_script"]


class StepRecorded(BaseException):
    """Raised out of ``optimizer.step()`` to stop the script once its step is recorded
    (a ``BaseException``: a script's ``except Exception:`` does not swallow it)."""


class _Boundaries:
    """Opens a recording at the first forward and after each optimizer step; keeps the last
    complete one (see the NOTE on the step boundary)."""

    def __init__(self, iteration: int, run_to_end: bool) -> None:
        self.iteration = iteration
        self.run_to_end = run_to_end
        self.steps = 0
        self.current: Recording | None = None
        self.done: Recording | None = None
        self.handles: list[Any] = []

    def install(self) -> None:
        module_hooks: Any = torch.nn.modules.module
        self.handles.append(module_hooks.register_module_forward_pre_hook(self.first_forward))
        hooks.install()  # the recorder's hooks, after ours (see the NOTE)
        self.handles.append(_step_hooks.add_post(self.after_step, rank=1))

    def remove(self) -> None:
        if self.current is not None:
            self.current.__exit__(None, None, None)
            self.current = None
        for handle in self.handles:
            handle.remove()
        self.handles = []
        hooks.uninstall()

    def first_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.steps == 0 and self.current is None and self.done is None:
            self._open()

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.current is not None:
            self.current.__exit__(None, None, None)
            self.done, self.current = self.current, None
        if self.steps >= self.iteration:
            if not self.run_to_end:
                raise StepRecorded
            return
        self._open()

    def _open(self) -> None:
        self.current = record()
        self.current.__enter__()


def _run(path: str, args: Sequence[str], run_name: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise InvalidArgumentError(
            f"tensorscope.plan: no script at {path!r}; give the path of a Python file."
        )
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        return runpy.run_path(path, run_name=run_name)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def plan_script(
    path: str, args: Sequence[str] = (), *, iteration: int = 2, run_to_end: bool = False
) -> tuple[MemoryPlan, int]:
    """Run a training script and plan one of its steps (see the NOTE on the step boundary).

    Returns:
        the plan and the number of the step it shows.

    Raises:
        PlanError: the script completed no optimizer step.
    """
    watcher = _Boundaries(iteration, run_to_end)
    watcher.install()
    try:
        _run(path, args, "__main__")
    except StepRecorded:
        pass
    finally:
        watcher.remove()
    if watcher.done is None:
        raise PlanError(
            f"tensorscope.plan: {path} completed no optimizer.step(), so no step was recorded; "
            "the command plans from the first module forward to the end of an optimizer "
            "step. For a step without an optimizer, name a function that runs one step: "
            "--step module:function."
        )
    return watcher.done.plan(), min(watcher.steps, iteration)


def plan_function(
    path: str | None, target: str, args: Sequence[str] = (), *, warmup: int = 1
) -> MemoryPlan:
    """Plan one call of ``module:function`` (after ``warmup`` unrecorded calls)."""
    module, _, name = target.partition(":")
    if not module or not name:
        raise InvalidArgumentError(
            f"tensorscope.plan: --step takes module:function (e.g. train:step); got {target!r}."
        )
    namespace: dict[str, Any]
    if path is not None and os.path.splitext(os.path.basename(path))[0] == module:
        namespace = _run(path, args, "__tensorscope_plan__")
    else:
        import importlib

        if path is not None:
            sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        namespace = vars(importlib.import_module(module))
    function = namespace.get(name)
    if not callable(function):
        raise InvalidArgumentError(
            f"tensorscope.plan: {module} has no function {name!r} to call as one step."
        )
    step: Callable[[], Any] = function
    for _ in range(warmup):
        step()
    with record() as rec:
        step()
    return rec.plan()
