"""``ts.record()``: record one step, then ``rec.plan()`` (docs/api.md §9).

# NOTE [what is installed, and for how long]
# Only while a ``with ts.record():`` block is open, and only on the thread that opened it
# (hooks installed for every thread return at once on the others): the recorder's dispatch mode
# (mode.py), saved-tensor hooks (autograd's ``saved_tensors_hooks``: what autograd saves for
# backward is the definition of an activation), torch's global module forward hooks (which
# module ran which ops), torch.optim's global step hooks (parameters' gradients and optimizer
# state), and an observer of torch.compile'd calls. At exit all of it is removed, whatever
# happened in the block. The saved-tensor hooks are why a step that calls
# ``torch.func.grad``/``vjp`` inside cannot be recorded with them: ``ts.record(saved_tensors=
# False)`` then finds activations by their lifetimes alone (analysis.py).
"""

from __future__ import annotations

import os
import threading
from types import TracebackType
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from tensorscope import _compiled
from tensorscope._slot import active_residency
from tensorscope._torch import graph_task_id, mode_on_top, pop_mode, push_mode
from tensorscope.errors import ArgumentTypeError, PlanError
from tensorscope.plan.analysis import build_plan
from tensorscope.plan.data import StepRecord
from tensorscope.plan.hooks import install, uninstall
from tensorscope.plan.mode import OPEN, PlanMode, observe_compiled, pack, see_through, unpack
from tensorscope.plan.model import MemoryPlan
from tensorscope.plan.recorder import Recorder
from tensorscope.plan.tiers import tier_reader

__all__ = ["Recording", "record"]

_lock = threading.Lock()


class Recording:
    """One recorded step: a context manager, then :meth:`plan`. Made by :func:`record`."""

    def __init__(self, *, saved_tensors: bool = True) -> None:
        if not isinstance(saved_tensors, bool):
            raise ArgumentTypeError(
                f"tensorscope.plan: ts.record(saved_tensors=...) takes a bool; got "
                f"{saved_tensors!r}"
            )
        self._saved_tensors = saved_tensors
        self._state = "new"  # "open", then "closed"
        self._recorder: Recorder | None = None
        self._mode: PlanMode | None = None
        self._hooks: saved_tensors_hooks | None = None
        self._record: StepRecord | None = None
        self._plan: MemoryPlan | None = None

    def __enter__(self) -> Recording:
        if self._state != "new":
            raise PlanError(
                "tensorscope.plan: this ts.record() block was already used; a recording holds "
                "one step: open a new `with ts.record() as rec:` for the next one."
            )
        thread = threading.get_ident()
        if thread in OPEN:
            raise PlanError(
                "tensorscope.plan: ts.record() is already open on this thread; recordings do "
                "not nest: record one step with one `with ts.record() as rec:` block, and end "
                "it before opening the next."
            )
        manager = active_residency()
        rec = Recorder(tier_reader(manager) if manager is not None else None)
        mode = PlanMode(rec)
        with _lock:
            OPEN[thread] = rec
            see_through()
            install()
            _compiled.OBSERVERS.append(observe_compiled)
        self._recorder = rec
        self._state = "open"
        try:
            if self._saved_tensors:
                self._hooks = saved_tensors_hooks(pack, unpack)
                self._hooks.__enter__()
            push_mode(mode)
            self._mode = mode
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._state == "open":
            self._close()

    def _close(self) -> None:
        rec = self._recorder
        assert rec is not None  # set by __enter__ before any path reaches here
        if self._mode is not None:
            _remove_mode(self._mode)
            self._mode = None
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        with _lock:
            OPEN.pop(rec.thread_id, None)
            if observe_compiled in _compiled.OBSERVERS:
                _compiled.OBSERVERS.remove(observe_compiled)
            uninstall()
        _mark_gradients(rec)
        self._record = rec.close()
        self._recorder = None
        self._state = "closed"

    @property
    def step(self) -> StepRecord | None:
        """What was recorded, as plain data (None until the block ended)."""
        return self._record

    def plan(self) -> MemoryPlan:
        """The memory plan of the recorded step (computed once, then the same object).

        Raises:
            PlanError: the block has not ended yet (call ``plan()`` after the ``with``
                block), or it ran no torch op.
        """
        if self._state != "closed" or self._record is None:
            where = "inside" if self._state == "open" else "before"
            raise PlanError(
                f"tensorscope.plan: rec.plan() was called {where} the `with ts.record() as "
                "rec:` block; the plan needs the whole step: call rec.plan() after the block "
                "ends."
            )
        if not self._record.ops:
            raise PlanError(
                "tensorscope.plan: the recorded block ran no torch op, so there is nothing to "
                "plan; put one training step (forward, backward, optimizer step) inside "
                "`with ts.record() as rec:`."
            )
        if self._plan is None:
            self._plan = build_plan(self._record)
        return self._plan


def record(*, saved_tensors: bool = True) -> Recording:
    """Record one step (forward, backward, optimizer step) for its memory plan.

    Works inside and outside ``ts.scope()``, with and without ``ts.manage``, with either scope
    engine, with ``torch.compile``'d code (a compiled graph counts as its outputs) and with
    ``torch.utils.checkpoint``. Nothing of the model, the optimizer or torch's state changes;
    everything installed for the recording is removed at the block's end.

    Args:
        saved_tensors: watch what autograd saves with saved-tensor hooks (the default; exact).
            ``False`` classifies activations by their lifetimes alone, for a step that runs
            ``torch.func.grad``/``vjp`` inside (those refuse to run under saved-tensor hooks).

    Returns:
        a :class:`Recording`: use it as ``with ts.record() as rec:``, then ``rec.plan()``.

    Raises:
        PlanError: at entry, when a recording is already open on this thread.

    Example:
        >>> import torch, tensorscope as ts
        >>> model = torch.nn.Linear(256, 256)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x = torch.randn(64, 256)
        >>> with ts.record() as rec:
        ...     model(x).square().mean().backward()
        ...     opt.step()
        >>> plan = rec.plan()
        >>> plan.at_peak["parameter"] == 256 * 256 * 4 + 256 * 4
        True
        >>> sum(plan.at_peak.values()) == plan.peak_bytes
        True
    """
    return Recording(saved_tensors=saved_tensors)


def _remove_mode(mode: PlanMode) -> None:
    """Take ``mode`` off this thread's dispatch stack, from under modes pushed after it."""
    above: list[Any] = []
    while torch._C._len_torch_dispatch_stack() > 0 and not mode_on_top(mode):
        above.append(torch._C._get_dispatch_stack_at(torch._C._len_torch_dispatch_stack() - 1))
        pop_mode()
    if mode_on_top(mode):
        pop_mode()
    for other in reversed(above):
        push_mode(other)


def _forget_in_child() -> None:
    """A process forked while recording (a DataLoader worker) records nothing: its ops are not
    the step's, and its copy of the recorder would only grow."""
    for rec in OPEN.values():
        rec.open = False
    OPEN.clear()
    depth = torch._C._len_torch_dispatch_stack()
    modes = [torch._C._get_dispatch_stack_at(i) for i in range(depth)]
    for mode in modes:
        if isinstance(mode, PlanMode):
            _remove_mode(mode)


os.register_at_fork(after_in_child=_forget_in_child)


def _mark_gradients(rec: Recorder) -> None:
    """Gradients that outlive the step (no ``zero_grad`` or ``set_to_none=False``)."""
    if graph_task_id() != -1:
        return
    for ref in rec.params:
        param = ref()
        if param is not None and param.grad is not None:
            owner = rec.watch(param, -1)
            rec.mark(param.grad, "gradient", owner, owner.name if owner is not None else "")
