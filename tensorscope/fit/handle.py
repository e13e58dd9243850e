"""``ts.fit(model, optimizer, budget=...)``: the handle that fits the user's training step into a
byte budget (docs/api.md §10, docs/fit.md).

Nothing runs at the call. The model's forward and the optimizer's step mark the step's
boundaries (NOTE [the step boundary]); the first training step is recorded (``ts.record``) while
the block chain runs checkpointed at every block and measures itself; at its end one decision
is taken (decide.py) and applied: rotor's schedule for the chain (``checkpoint_chain``), where
nothing reads all gradients the optimizer's update inside backward (inbackward.py), and where
the budget needs it the optimizer state in the next tier between updates (statestore.py).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from tensorscope import _step_hooks
from tensorscope._copies import leave_out_of_copies
from tensorscope._units import format_bytes, parse_bytes
from tensorscope.checkpoint.blocks import CheckpointedChain, checkpoint_chain
from tensorscope.checkpoint.offloaded import OFFLOAD_MIN_BYTES, OffloadModel
from tensorscope.errors import (
    ArgumentTypeError,
    FitWarning,
    InvalidArgumentError,
    PlanError,
    ResidencyError,
    ScheduleError,
)
from tensorscope.fit.account import StepBase, chain_backward_peak, placed_peak, step_base
from tensorscope.fit.decide import Decision, decide
from tensorscope.fit.inbackward import InBackward, parameters_of, unknown_optimizer
from tensorscope.fit.loss import LossMode
from tensorscope.fit.offload import ActivationOffloader
from tensorscope.fit.offload_rules import Bandwidth
from tensorscope.fit.paramplace import ParamPlacer, measure_mapping, placeable
from tensorscope.fit.report import Facts, explain
from tensorscope.fit.rows import ROW_BLOCK_BYTES
from tensorscope.fit.statestore import (
    StateStore,
    first_step_floor,
    per_parameter_state_bytes,
    row_safe,
)
from tensorscope.plan import hooks as plan_hooks
from tensorscope.plan.mode import recorder_here
from tensorscope.plan.model import MemoryPlan
from tensorscope.plan.record import Recording, record

__all__ = ["Fit", "make_fit"]

_SUB = "tensorscope.fit"
_lock = threading.Lock()
# model or optimizer -> its Fit, both weakly: a Fit lives as long as its model's pre-hook does
_FITTED: weakref.WeakKeyDictionary[Any, weakref.ref[Fit]] = weakref.WeakKeyDictionary()

# NOTE [the step boundary]
# A step begins at the model's first training forward (train() mode, grad enabled) after the
# previous optimizer step and ends when `optimizer.step()` returns (its step post-hook). The
# forward pre-hook is the model's own (with kwargs: the batch's bytes tell a larger batch), the
# post-hook a global one, filtered (ours, see _step_hooks.py: torch's dict of global step hooks
# is never mutated while another thread may be stepping); both are removed by remove(). A
# recording opened in the pre-hook and closed in the post-hook registers no global hook there:
# the recorder's global hooks are installed once, when the Fit is made (torch iterates its hook
# dicts while calling them). The step's blocks are found in the plan by module identity
# (`plan.module_ids`), which holds whichever module the recorder saw first as the root.
#
# NOTE [steps of a fit]
#   measure  (step 1; again after a larger batch): recorded as plan_before; the chain runs
#            every block checkpointed and measures itself; gradients are kept. At its end
#            decide() runs; a ScheduleError is raised from optimizer.step() and again at every
#            later training forward (nothing runs past a budget it cannot meet).
#   run      (from step 2): the decision. Step 2 re-times the chain (CheckpointedChain), step 3
#            is recorded as plan_after: its peak is the measured one; above the budget, the
#            excess is taken off the chain's share and the decision is taken again (FitWarning).
#            Later steps are timed.


# NOTE [gradients seen as they are made]
# The recorder knows a `.grad` as a gradient when an op makes it inside AccumulateGrad or at the
# optimizer step's hooks; a gradient AccumulateGrad steals from its producer (the common case:
# no op runs) is known only at the step. Reads before the step (`clip_grad_norm_`, a
# GradScaler's `unscale_`) would not count as gradient readers, and freeing gradients at their
# update would change what they see. So while the measuring step is recorded, each parameter's
# post-accumulate-grad hook tells the recorder about its gradient at once.


def _note_gradient(param: torch.Tensor) -> None:
    rec = recorder_here()
    if rec is not None:
        plan_hooks._note_parameter(rec, param)


def _weak_after(ref: weakref.ref[Fit]) -> Any:
    def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        fit = ref()
        if fit is not None:
            fit._after(optimizer, args, kwargs)

    return after


def _release(handle: Any) -> None:
    handle.remove()
    plan_hooks.uninstall()


def _world_size() -> int:
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size())
    return 1


def _input_nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    total = 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            total += value.nbytes
        elif isinstance(value, (tuple, list)):
            total += sum(v.nbytes for v in value if isinstance(v, torch.Tensor))
    return total


class Fit:
    """A model and its optimizer fitted into a byte budget; made by :func:`tensorscope.fit`.

    Attributes:
        model, optimizer: what was fitted.
        budget_bytes: the budget, in bytes.
        chain: the block chain (a :class:`~tensorscope.checkpoint.CheckpointedChain`), or None
            when the model has none (``chain_note`` says why).
        plan_before: the recorded first step (a :class:`~tensorscope.MemoryPlan`), once it ran.
        plan_after: a recorded step under the decision (the third step), once it ran.
        decision: the :class:`~tensorscope.fit.decide.Decision` in force, once taken.
        steps: optimizer steps seen.
        removed: whether :meth:`remove` ran.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, budget: int, blocks: str | None
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.budget_bytes = budget
        self.chain: CheckpointedChain | None = None
        self.chain_note = ""
        try:
            self.chain = checkpoint_chain(model, None, blocks=blocks)
        except InvalidArgumentError as exc:
            if blocks is not None:
                raise
            self.chain_note = str(exc).removeprefix("tensorscope.checkpoint: ").split(". ")[0]
        self.optimizer_note = unknown_optimizer(optimizer)
        self.plan_before: MemoryPlan | None = None
        self.plan_after: MemoryPlan | None = None
        self.decision: Decision | None = None
        self.grads_kept_because: list[str] = []
        self.steps = 0
        self.removed = False
        self.notes: list[str] = []
        self._state = "measure"
        self._error: ScheduleError | None = None
        self._recording: Recording | None = None
        self._recording_kind = ""
        self._step_start: float | None = None
        self._forwards = 0
        self._grads_at_start = False
        self._batch_nbytes = 0
        self._after_at = 0
        self._slack = 0
        self._retries = 0
        self._times: list[float] = []
        self._inb: InBackward | None = None
        self._states: StateStore | None = None
        self._bandwidth: Bandwidth | None = None
        self._offloader: ActivationOffloader | None = None
        self._offload_tier: str | None = None
        self._offload_off = ""  # why offload was taken out of the choices (a failed write)
        self._offload_read_ahead = 0
        self._recorded_at = 0.0
        self._placer: ParamPlacer | None = None  # NOTE [parameters between their uses]
        self._place_off = ""  # why the chain's parameters stay in memory (a failed write)
        self._map_rate: float | None = None
        self._corrected_peak: int | None = None  # plan_after's peak, read-ahead and placement
        self._handles: list[Any] = []
        self._grad_hooks: list[Any] = []
        plan_hooks.install()  # NOTE [the step boundary]: before any recording opens in a hook
        self._handles.append(model.register_forward_pre_hook(self._before, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._after_forward, always_call=True))
        self._handles.append(leave_out_of_copies(model, self._handles[-2:]))  # _copies.py
        self._loss = threading.local()  # this thread's LossMode stack (fit/loss.py)
        self.loss_routed = 0
        self.loss_shape: tuple[int, ...] = ()
        # global, after the recorder's (rank 0): torch runs an optimizer's own post hooks
        # before the global ones, and the recorder notes optimizer state in its hook
        self._global = _step_hooks.add_post(_weak_after(weakref.ref(self)), rank=1)
        # a model dropped without remove(): its hooks go with it, and so do these
        self._finalizer = weakref.finalize(self, _release, self._global)

    # -- the step boundary -------------------------------------------------------------------

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.removed or not module.training or not torch.is_grad_enabled():
            return
        if self._error is not None:
            raise ScheduleError(str(self._error))
        if self._step_start is None:
            self._begin_step(_input_nbytes(args, kwargs))
        self._forwards += 1
        if not torch.compiler.is_compiling():  # NOTE [the loss's gradient in place]
            mode = LossMode()
            mode.__enter__()  # type: ignore[no-untyped-call]
            self._loss_stack().append(mode)

    def _loss_stack(self) -> list[LossMode]:
        stack: list[LossMode] | None = getattr(self._loss, "stack", None)
        if stack is None:
            stack = self._loss.stack = []
        return stack

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._loss_stack()
        if stack:
            mode = stack.pop()
            mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            if mode.routed:
                self.loss_routed += mode.routed
                self.loss_shape = mode.shape

    def _begin_step(self, batch_nbytes: int) -> None:
        self._step_start = time.perf_counter()
        self._forwards = 0
        grads = any(p.grad is not None for p in parameters_of(self.optimizer))
        if self._state == "run" and batch_nbytes > self._batch_nbytes:
            self.notes.append(
                f"step {self.steps + 1}: the batch grew ({format_bytes(self._batch_nbytes)} -> "
                f"{format_bytes(batch_nbytes)} of inputs): measured and decided again"
            )
            self._state = "measure"
        if self._state == "run" and grads and self._inb is not None:
            self._inb.remove()
            self._inb = None
            reason = (
                "gradients existed when a step began (accumulated across optimizer steps, or "
                "zero_grad(set_to_none=False)): they are the optimizer's input"
            )
            self._redecide(reason)
        if self._state == "measure":
            if self._inb is not None:  # the measuring step keeps gradients, as step 1 did
                self._inb.remove()
                self._inb = None
            if self._states is not None:  # and its optimizer state resident, as step 1 did
                self._states.disable()
            self._grads_at_start = grads
            self._batch_nbytes = max(self._batch_nbytes, batch_nbytes)
            self._open("before")
        elif self.plan_after is None and self.steps >= self._after_at:
            if self._offloader is not None:
                self._offloader.reset_peak()
                self._offloader.log_read_ahead(True)  # the recorded step's
            if self._placer is not None:
                self._placer.log = [(time.perf_counter(), self._placer.resident)]
            self._recorded_at = time.perf_counter()  # the recording's clock starts now
            self._open("after")

    def _open(self, kind: str) -> None:
        rec = record()
        try:
            rec.__enter__()
        except PlanError:  # the user records this step themselves: plan from a later one
            return
        self._recording, self._recording_kind = rec, kind
        if kind == "before":  # NOTE [gradients seen as they are made]
            self._grad_hooks = [
                p.register_post_accumulate_grad_hook(_note_gradient)  # type: ignore[no-untyped-call]
                for p in parameters_of(self.optimizer)
                if p.requires_grad
            ]
        # NOTE [the step boundary]: the recorder's own pre-hook ran before this one, with no
        # recording open; the model's call is opened now, so that paths are the model's.
        plan_hooks._before_forward(self.model, ())

    def _close(self) -> MemoryPlan | None:
        rec, self._recording = self._recording, None
        while self._grad_hooks:
            self._grad_hooks.pop().remove()
        if rec is None:
            return None
        rec.__exit__(None, None, None)
        try:
            return rec.plan()
        except PlanError:
            return None

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is not self.optimizer or self.removed:
            return
        if self._states is not None:  # after the recorder's hook: it saw the state resident
            self._states.after_step()
        if self._inb is not None and self._inb.updating:
            return
        if self._states is not None and self._states.stepping:  # one parameter's update
            return
        if self._step_start is None:
            return
        elapsed = time.perf_counter() - self._step_start
        self._step_start = None
        self.steps += 1
        kind = self._recording_kind if self._recording is not None else ""
        plan = self._close()
        states = self._states
        if states is not None and states.enabled and states.off and self.plan_before is not None:
            # NOTE [a full disk] (statestore.py): the state stayed in memory this step
            self.notes.append(f"step {self.steps}: {states.off}; decided again without")
            states.disable()
            self.decision = None
            self._apply(self.plan_before, self._inb is not None)
            return
        if kind == "before" and plan is not None:
            self.plan_before = plan
            self._decide_now()
        elif kind == "after" and plan is not None:
            self.plan_after = plan
            placed = self._placed_names()
            held: list[tuple[float, int]] = []
            if placed and self._placer is not None:
                held = [(t - self._recorded_at, b) for t, b in self._placer.log or []]
                self._corrected_peak = placed_peak(plan, placed, held)
            if self._placer is not None:
                self._placer.log = None  # logged for the recorded step only
            offloading = self._offloader is not None and bool(self.chain and self.chain.offloaded)
            if offloading and self._offloader is not None:
                stats = self._offloader.stats()
                self._offload_read_ahead = stats.peak_read_ahead_bytes
                log = [(t - self._recorded_at, b) for t, b in self._offloader.log_read_ahead(False)]
                backward = chain_backward_peak(
                    plan, self._chain_paths(plan), log, placed=placed, held=held
                )
                whole = self._corrected_peak
                self._corrected_peak = max(
                    whole if whole is not None else plan.peak_bytes, backward
                )
                if stats.write_errors and self.plan_before is not None:
                    self._offload_off = (
                        f"writing activations to the {stats.tier} tier failed: {stats.last_error}"
                    )
                    warnings.warn(
                        f"{_SUB}: {stats.write_errors} offloaded activations could not be "
                        f"written to the {stats.tier} tier ({stats.last_error}); they stayed "
                        f"in memory (nothing is lost); deciding again without offload",
                        FitWarning,
                        stacklevel=2,
                    )
                    self._apply(self.plan_before, self._inb is not None)
                    return
            self._check(plan)
        elif self._state == "run" and self.plan_after is not None:
            self._times.append(elapsed)

    # -- deciding ----------------------------------------------------------------------------

    def _why_grads_kept(self, plan: MemoryPlan) -> list[str]:
        reasons = []
        if self.optimizer_note is not None:
            reasons.append(self.optimizer_note + "; treated conservatively")
        if plan.gradient_readers:
            ops = ", ".join(dict.fromkeys(plan.gradient_readers))
            reasons.append(
                f"the recorded step reads gradients outside backward and the optimizer step "
                f"({ops}: clip_grad_norm_, a GradScaler's unscale_, or your own code): they "
                f"must all exist at once"
            )
        if self._forwards > 1:
            reasons.append(
                f"gradient accumulation: {self._forwards} forwards per optimizer step (the "
                f"update needs every micro-batch's gradient)"
            )
        ranks = _world_size()
        if ranks > 1:
            reasons.append(
                f"a process group of {ranks} ranks is initialized: DDP and FSDP average each "
                f"gradient across ranks after autograd accumulates it, so an update at "
                f"accumulation would use this rank's gradient alone"
            )
        if self._grads_at_start:
            reasons.append(
                "gradients existed when the step began (accumulated across optimizer steps, "
                "or zero_grad(set_to_none=False))"
            )
        return reasons

    def _bases(
        self, plan: MemoryPlan, free_gradients: bool, placed: bool = False
    ) -> list[StepBase]:
        """The ways of running the step outside the chain; ``placed``: those with the chain's
        parameters in files between their uses (gradients freed at their update only: a
        whole optimizer step would map every parameter in at once)."""
        paths = self._chain_paths(plan)
        where: dict[str, Any] = {}
        extra_s = 0.0
        if placed:
            names, window, nbytes = self._placeable(plan)
            where = {"placed": names, "placed_window": window}
            extra_s = 3 * nbytes / self._mapping_rate()  # forward, recomputation, backward
        bases = [] if placed else [step_base(plan, paths, free_gradients=False)]
        if free_gradients:
            bases.append(step_base(plan, paths, free_gradients=True, **where))
        one, tensors = per_parameter_state_bytes(self.optimizer)
        # ts.manage places the state itself: never both; None: the next tier cannot be written
        bandwidth = self._state_bandwidth() if one and not self._managed() else None
        if bandwidth is not None:
            block = ROW_BLOCK_BYTES if self._row_safe() else 0
            for base in list(bases):
                moved = step_base(
                    plan,
                    paths,
                    free_gradients=base.free_gradients,
                    offload_state=True,
                    state_block=block,
                    stepwise=self._stepwise_ok(),
                    **(where if base.free_gradients else {}),
                )
                if moved.offloaded_bytes:
                    seconds = bandwidth.seconds(moved.offloaded_bytes, tensors)
                    bases.append(dataclasses.replace(moved, seconds=moved.seconds + seconds))
        if extra_s:
            bases = [
                dataclasses.replace(b, seconds=b.seconds + extra_s) if b.placed_bytes else b
                for b in bases
            ]
        return bases

    def _placeable(self, plan: MemoryPlan) -> tuple[tuple[str, ...], int, int]:
        """Names of the chain's parameters that can be placed in files, the largest block's
        bytes of them (mapped in at a time) and their total bytes."""
        chain = self.chain
        if chain is None:  # pragma: no cover - callers check
            return (), 0, 0
        names = {id(p): name for name, p in self.model.named_parameters()}
        per_block = placeable(self.model, chain.blocks)
        known = {life.name for life in plan.lifetimes if life.category == "parameter"}
        chosen = [[p for p in ps if names.get(id(p)) in known] for ps in per_block]
        sizes = [sum(p.untyped_storage().nbytes() for p in ps) for ps in chosen]
        return (
            tuple(names[id(p)] for ps in chosen for p in ps),
            max(sizes, default=0),
            sum(sizes),
        )

    def _can_place(self, free_gradients: bool) -> bool:
        chain = self.chain
        if not (
            free_gradients
            and not self._place_off
            and not self._managed()
            and chain is not None
            and chain.profile is not None
            and any(placeable(self.model, chain.blocks))
        ):
            return False
        if self._map_rate is None:
            try:
                self._map_rate = measure_mapping()
            except ResidencyError as exc:  # the disk tier cannot be written (a full disk)
                self._place_off = f"the disk tier cannot be written: {exc}"
                return False
        return True

    def _mapping_rate(self) -> float:
        return self._map_rate if self._map_rate is not None else measure_mapping()

    def _stepwise_ok(self) -> bool:
        """Whether a kept-gradient step can run one parameter at a time (statestore.py NOTE
        [a kept-gradient step one parameter at a time]): an optimizer ts.fit knows."""
        return self.optimizer_note is None

    def _row_safe(self) -> bool:
        return self.optimizer_note is None and row_safe(self.optimizer)

    def _state_bandwidth(self) -> Bandwidth | None:
        """The next tier's; None when it cannot be written (statestore.py NOTE [a full disk])."""
        states = self._state_store()
        if self._bandwidth is None and not states.off:
            device = next((p.device for p in parameters_of(self.optimizer)), torch.device("cpu"))
            self._bandwidth = states.measure(device)
        return None if states.off else self._bandwidth

    def _offload_model(self) -> OffloadModel | None:
        """What offloading each block's saved tensors moves (measured in the first step) and
        costs (the next tier's measured bandwidth); None when no block saves enough to move."""
        chain = self.chain
        if chain is None or chain.profile is None or self._managed() or self._offload_off:
            return None
        layers = chain.profile.layers
        if not any(layer.offload_nbytes for layer in layers):
            return None
        bandwidth = self._state_bandwidth()
        if bandwidth is None:  # the next tier cannot be written (a full disk)
            return None
        self._offload_tier = bandwidth.tier
        return OffloadModel(
            tuple(layer.offload_nbytes for layer in layers),
            tuple(bandwidth.seconds(p.offload_nbytes, p.offload_tensors) for p in layers),
        )

    def _activation_offloader(
        self, model: OffloadModel | None, blocks: tuple[int, ...]
    ) -> ActivationOffloader | None:
        """The offloader of the chain's blocks (made once, when a decision first offloads)."""
        if model is None or not blocks:
            return None
        if self._offloader is None:
            device = next((p.device for p in parameters_of(self.optimizer)), torch.device("cpu"))
            try:
                self._offloader = ActivationOffloader(
                    device,
                    min_bytes=OFFLOAD_MIN_BYTES,
                    max_in_flight_bytes=max(1, model.in_flight_nbytes),
                )
            except ResidencyError as exc:  # its files cannot be made (a full disk)
                self._offload_off = f"the {self._offload_tier} tier cannot be written: {exc}"
        return self._offloader

    def _state_store(self) -> StateStore:
        if self._states is None:
            self._states = StateStore(self.optimizer, known=self.optimizer_note is None)
        return self._states

    def _chain_paths(self, plan: MemoryPlan) -> list[str]:
        chain = self.chain
        if chain is None or chain.profile is None:
            return []
        found = [plan.module_ids.get(id(block)) for block in chain.blocks]
        return [p for p in found if p is not None]

    def _decide_now(self) -> None:
        plan = self.plan_before
        if plan is None:  # pragma: no cover - called after a measuring step
            return
        self.grads_kept_because = self._why_grads_kept(plan)
        self._apply(plan, not self.grads_kept_because)
        if plan.peak_bytes > self.budget_bytes:
            warnings.warn(
                f"{_SUB}: the measuring step (every block recomputed, gradients kept) held "
                f"{format_bytes(plan.peak_bytes)}, above the budget of "
                f"{format_bytes(self.budget_bytes)}; later steps run the decision, predicted "
                f"at {format_bytes(self._predicted_peak())}",
                FitWarning,
                stacklevel=2,
            )

    def _redecide(self, reason: str) -> None:
        if reason not in self.grads_kept_because:
            self.grads_kept_because.append(reason)
        if self.plan_before is not None:
            self._apply(self.plan_before, False)

    def _apply(self, plan: MemoryPlan, free_gradients: bool) -> None:
        chain = self.chain
        measured = chain is not None and chain.profile is not None and self._chain_paths(plan)
        budget = self.budget_bytes - self._slack
        offload = self._offload_model() if measured else None

        def decide_with(bases: list[StepBase]) -> Decision:
            off = self._states.off if self._states is not None else ""  # NOTE [a full disk]
            return decide(
                budget,
                bases,
                chain.profile.to_chain() if measured and chain and chain.profile else None,
                reserve=chain.reserved_nbytes if measured and chain else 0,
                slots=chain.slots if chain is not None else 500,
                what=f"a training step of {type(self.model).__name__}"
                + (f" with the optimizer state in memory ({off})" if off else ""),
                offload=offload,
            )

        try:
            try:
                decision = decide_with(self._bases(plan, free_gradients))
            except ScheduleError:
                # NOTE [parameters between their uses]: only when nothing fits without
                if not (measured and self._can_place(free_gradients)):
                    raise
                decision = decide_with(self._bases(plan, free_gradients, placed=True))
            if measured and chain is not None:
                chain.loss_tmp_nbytes = decision.chosen.base.loss_tmp
                blocks = decision.chosen.offloaded
                offloader = self._activation_offloader(offload, blocks)
                if blocks and offloader is None:  # its tier cannot be written: without offload
                    self._apply(plan, free_gradients)
                    return
                chain.set_offload(offloader, offload, blocks)
                chain.compute_sequence(decision.chosen.chain_limit)
        except ScheduleError as exc:
            self._error, self._state = exc, "failed"
            raise
        self.decision = decision
        if not self._place(decision.chosen.base.placed_bytes > 0):
            self.decision = None  # a write failed: decided again without placing
            self._apply(plan, free_gradients)
            return
        # NOTE [updates in row blocks] (statestore.py)
        offloaded = decision.chosen.base.state_offloaded
        stepwise = offloaded and not decision.free_gradients and self._stepwise_ok()
        in_rows = offloaded and (decision.free_gradients or stepwise)
        if offloaded:
            states = self._state_store()
            states.enabled = True
            states.stepwise = stepwise
            states.set_row_block(ROW_BLOCK_BYTES if in_rows and self._row_safe() else 0)
            states.spill_or_warn(dict(self.optimizer.state))
            if states.off:  # NOTE [a full disk] (statestore.py): decided again without
                states.disable()
                self.decision = None
                self._apply(plan, free_gradients)
                return
        elif self._states is not None:
            self._states.disable()
        if decision.free_gradients and self._inb is None:
            self._inb = InBackward(self.optimizer)
        elif not decision.free_gradients and self._inb is not None:
            self._inb.remove()
            self._inb = None
        if self._inb is not None:
            self._inb.in_rows = self._states.update_in_rows if in_rows and self._states else None
        self._state = "run"
        self._offload_read_ahead = 0
        self._corrected_peak = None
        self._after_at = self.steps + 1  # step +1 re-times the chain; the next is recorded
        self.plan_after = None
        self._times = []

    def _place(self, on: bool) -> bool:
        """Put the chain's parameters in files (``on``) or back in memory; False when a write
        failed (those parameters stayed in memory: FitWarning, placing is then off)."""
        chain = self.chain
        placer = self._placer
        if not on or chain is None:
            if placer is not None and placer.placed:
                placer.restore()
            if chain is not None:
                chain.placer = None
            return True
        if placer is None:
            placer = self._placer = ParamPlacer(placeable(self.model, chain.blocks))
        placer.place()
        if placer.kept:
            self._place_off = f"writing parameters to the disk tier failed: {placer.kept[0]}"
            placer.restore()
            chain.placer = None
            return False
        chain.placer = placer
        return True

    def _placed_names(self) -> tuple[str, ...]:
        """Names of the parameters in files now (none when not placed)."""
        placer = self._placer
        if placer is None or not placer.placed:
            return ()
        ids = {id(p) for ps in placer.blocks for p in ps}
        return tuple(name for name, p in self.model.named_parameters() if id(p) in ids)

    def _predicted_peak(self) -> int:
        return self.decision.chosen.predicted_peak if self.decision is not None else 0

    def _check(self, plan: MemoryPlan) -> None:
        # with blocks offloaded, what the offloader held read back ahead of use counts too
        # (the recording sees such a tensor from its use on): measured_peak adds it op by op
        excess = self.measured_peak(plan) - self.budget_bytes
        if excess <= 0 or self.plan_before is None:
            return
        self._retries += 1
        again = self._retries <= 2
        warnings.warn(
            f"{_SUB}: step {self.steps} held {format_bytes(self.measured_peak(plan))}, "
            f"{format_bytes(excess)} above the budget of {format_bytes(self.budget_bytes)} "
            f"(predicted {format_bytes(self._predicted_peak())})"
            + ("; deciding again with that much less for the chain" if again else ""),
            FitWarning,
            stacklevel=2,
        )
        if again:
            self._slack += excess
            self.notes.append(
                f"step {self.steps}: measured {format_bytes(excess)} above the budget; "
                f"decided again with {format_bytes(self._slack)} held back"
            )
            self._apply(self.plan_before, self._inb is not None)

    def measured_peak(self, plan: MemoryPlan) -> int:
        """``plan``'s peak; for ``plan_after``, with what the recording does not see as it was:
        where blocks are offloaded, at least the chain's backward peak with what the offloader
        held read back ahead of use added op by op (the recording sees a read-back tensor from
        its use on; reads happen only in the chain's backward); where the chain's parameters
        are in files, those counted as mapped in op by op instead of whole."""
        if plan is self.plan_after and self._corrected_peak is not None:
            return self._corrected_peak
        return plan.peak_bytes

    # -- public --------------------------------------------------------------------------------

    @property
    def measured_step_s(self) -> float | None:
        """Median seconds of the steps timed under the decision (None before any)."""
        return statistics.median(self._times) if self._times else None

    def explain(self) -> str:
        """The plan in words: per block kept / recomputed / offloaded, where model state lives,
        whether gradients are freed at their update (or why not), predicted and measured peak
        and step time. See docs/fit.md for a real one.

        Example:
            >>> import torch, tensorscope as ts
            >>> net = torch.nn.Linear(4, 4)
            >>> fit = ts.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), budget="1MiB")
            >>> print(fit.explain().splitlines()[1])
              not measured yet: the first training step is recorded, then the plan is decided
            >>> fit.remove()
        """
        chain = self.chain
        return explain(
            Facts(
                model=type(self.model).__name__,
                optimizer=type(self.optimizer).__name__,
                budget_bytes=self.budget_bytes,
                chain_path=chain.path if chain is not None else None,
                chain_blocks=(type(chain.blocks[0]).__name__, len(chain.blocks)) if chain else None,
                chain_note=self.chain_note,
                schedule_limit=chain.solved_limit if chain is not None else None,
                decision=self.decision,
                grads_kept_because=tuple(self.grads_kept_because),
                plan_before=self.plan_before,
                plan_after=self.plan_after,
                measured_step_s=self.measured_step_s,
                timed_steps=len(self._times),
                state_where=self._state_where(),
                loss_shape=self.loss_shape if self.loss_routed else None,
                notes=tuple(self.notes),
                error=str(self._error) if self._error is not None else None,
                removed=self.removed,
                offload_tier=None if self._offload_off else self._offload_tier,
                offload_why_not=self._offload_why_not(),
                offload_read_ahead=self._offload_read_ahead,
                measured_peak=self.measured_peak(self.plan_after) if self.plan_after else 0,
            )
        )

    def _offload_why_not(self) -> str:
        if self._offload_off:
            return self._offload_off
        if self._states is not None and self._states.off:
            return self._states.off
        if self._managed():
            return "the model is under ts.manage"
        chain = self.chain
        if chain is None or chain.profile is None:
            return "no block chain measured"
        return f"no block saves tensors of {format_bytes(OFFLOAD_MIN_BYTES)} or more of its own"

    def _managed(self) -> bool:
        from tensorscope.manage import ManagedParameter

        return any(isinstance(p, ManagedParameter) for p in parameters_of(self.optimizer))

    def _state_where(self) -> str:
        if self._managed():
            return "managed by ts.manage: the residency manager's tiers under its own budget"
        base = self.decision.chosen.base if self.decision is not None else None
        in_files = base is not None and base.placed_bytes > 0 and self._placer is not None
        placed = f"; the chain's parameters stay in memory ({self._place_off})" * bool(
            self._place_off
        )
        if in_files and self._placer is not None:
            placed = (
                f"; the chain's parameters ({format_bytes(self._placer.placed_nbytes)}) in the "
                f"disk tier's files between their uses, one block's mapped in at a time "
                f"(NOTE [parameters between their uses])"
            )
        if base is not None and base.state_offloaded and self._states is not None:
            when = "read back for optimizer.step()"
            if base.free_gradients or self._states.stepwise:
                when = (
                    "one parameter's read back for its update inside backward"
                    if base.free_gradients
                    else "optimizer.step() run one parameter at a time, each one's read back "
                    "for its update"
                )
                if self._states.row_block:
                    when += (
                        f", state above {format_bytes(self._states.row_block)} a block of rows "
                        f"at a time ({self._states.block_updates} such updates so far)"
                    )
            return (
                f"{'other ' if in_files else ''}parameters and gradients resident on the device; "
                f"optimizer state in the "
                f"{self._states.tier} tier between updates ({when}; "
                f"{format_bytes(base.offloaded_bytes)} written and read each step)" + placed
            )
        if in_files:
            return "other parameters, gradients and optimizer state resident on the device" + placed
        return (
            "resident on the device (parameters not moved: see docs/fit.md, model state)" + placed
        )

    def remove(self) -> None:
        """Give the model and optimizer back exactly as they were (their current values):
        block forwards, hooks, the recording of a step in progress. Idempotent.

        Example:
            >>> import torch, tensorscope as ts
            >>> net = torch.nn.Linear(4, 4)
            >>> fit = ts.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), budget="1MiB")
            >>> fit.remove(); fit.remove()
            >>> len(net._forward_pre_hooks)
            0
        """
        if self.removed:
            return
        self.removed = True
        self._close()
        if self._inb is not None:
            self._inb.remove()
            self._inb = None
        if self._states is not None:
            self._states.close()
        if self.chain is not None:
            self.chain.remove()
        if self._placer is not None:  # the parameters back in memory, their current values
            self._placer.restore()
        if self._offloader is not None:  # graphs still alive keep reading their tensors
            self._offloader.close()
        while self._handles:
            self._handles.pop().remove()
        self._finalizer()  # the global post-hook and the recorder's hooks, once
        with _lock:
            for key in (self.model, self.optimizer):
                ref = _FITTED.get(key)
                if ref is not None and ref() is self:
                    del _FITTED[key]

    def __repr__(self) -> str:
        state = "removed" if self.removed else self._state
        return (
            f"<Fit {type(self.model).__name__} + {type(self.optimizer).__name__}, budget "
            f"{format_bytes(self.budget_bytes)}, {self.steps} steps, {state}>"
        )


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    # accelerate's AcceleratedOptimizer is an Optimizer whose step() steps the one it wraps
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError(
            f"{_SUB}: ts.fit needs a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )
    return optimizer


def make_fit(model: Any, optimizer: Any, budget: Any, *, blocks: str | None = None) -> Fit:
    """:func:`tensorscope.fit` (see its docstring)."""
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"{_SUB}: ts.fit needs an nn.Module; got {type(model).__name__}")
    opt = _unwrap(optimizer)
    nbytes = parse_bytes(budget, what="budget", subsystem=_SUB)
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            raise InvalidArgumentError(
                f"{_SUB}: HF gradient checkpointing is on ({name or type(module).__name__}); "
                f"ts.fit decides recomputation itself. Call model.gradient_checkpointing_disable() "
                f"first."
            )
    with _lock:
        for key, what in ((model, "model"), (opt, "optimizer")):
            ref = _FITTED.get(key)
            other = ref() if ref is not None else None
            if other is not None and not other.removed:
                raise InvalidArgumentError(
                    f"{_SUB}: this {what} ({type(key).__name__}) is already fitted "
                    f"({other!r}); call its remove() before ts.fit again"
                )
        handle = Fit(model, opt, nbytes, blocks)
        _FITTED[model] = _FITTED[opt] = weakref.ref(handle)
    _warn_if_the_first_step_cannot_fit(opt, nbytes)
    return handle


def _warn_if_the_first_step_cannot_fit(optimizer: torch.optim.Optimizer, budget: int) -> None:
    """Say before it runs that the measuring step will pass the budget: it keeps gradients and
    its ``optimizer.step()`` makes the whole optimizer state (on CUDA: an out-of-memory error
    the user should be able to foresee)."""
    params, grads, state = first_step_floor(optimizer)
    floor = params + grads + (state or 0)
    if floor <= budget:
        return
    parts = f"parameters {format_bytes(params)} + gradients {format_bytes(grads)}"
    if state is None:
        parts += " (+ the state of an optimizer ts.fit does not know)"
    elif state:
        parts += f" + optimizer state {format_bytes(state)}"
    warnings.warn(
        f"{_SUB}: the first step, recorded to measure, keeps every gradient and its "
        f"optimizer.step() makes the whole optimizer state: it holds at least {parts} = "
        f"{format_bytes(floor)}, above the budget of {format_bytes(budget)}. It will pass the "
        f"budget once (on a GPU it may run out of memory); the steps after it run under the "
        f"budget when a plan fits it.",
        FitWarning,
        stacklevel=4,  # the caller of ts.fit()
    )
