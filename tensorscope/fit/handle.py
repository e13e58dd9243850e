"""``ts.fit(model, optimizer, budget=...)``: the handle that fits the user's training step into a
byte budget (docs/api.md §10, docs/fit.md).

Nothing runs at the call. The model's forward and the optimizer's step mark the step's
boundaries (NOTE [the step boundary], parts/record.py); the handle moves through its phases
(phase.py, NOTE [steps of a fit]) and tells its parts (NOTE [fit as parts], parts/__init__.py)
what happens: the first training step is recorded while the block chain runs checkpointed at
every block and measures itself; at its end one decision is taken (decider.py, decide.py) and
each part applies its share of it. An exception out of a step aborts it (NOTE [an aborted
step], abort.py).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import warnings
import weakref
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tensorscope import _step_hooks
from tensorscope._copies import Attached, leave_out_of_copies
from tensorscope._torch import caller_of_disabled, compiler_disabled
from tensorscope._units import format_bytes
from tensorscope.checkpoint.blockprobe import retimed
from tensorscope.errors import FitWarning, ScheduleError
from tensorscope.fit import fitted
from tensorscope.fit.abort import (
    OpenSteps,
    dead,
    running,
    updated_words,
    warn_updated,
    watch_backward,
)
from tensorscope.fit.account import chain_backward_peak, placed_peak
from tensorscope.fit.decide import Candidate, Decision
from tensorscope.fit.decider import Decider
from tensorscope.fit.inbackward import parameters_of
from tensorscope.fit.parts import Decided, Parts, Step
from tensorscope.fit.parts.across import AcrossRanks
from tensorscope.fit.parts.chain import ChainExecutor, find_the_chain
from tensorscope.fit.parts.chunked import ChunkedLoss
from tensorscope.fit.parts.compiled import CompiledRun
from tensorscope.fit.parts.inbackward import InBackwardUpdates
from tensorscope.fit.parts.loss import LossRouting
from tensorscope.fit.parts.offload import ActivationOffload
from tensorscope.fit.parts.place import ParamPlacement
from tensorscope.fit.parts.record import StepRecorder
from tensorscope.fit.parts.states import OptimizerStates
from tensorscope.fit.phase import Event, Phase, advance
from tensorscope.fit.ranks import Ranks
from tensorscope.fit.report import Facts, explain
from tensorscope.fit.where import offload_why_not, state_where
from tensorscope.plan.model import MemoryPlan
from tensorscope.residency.backends import Backend, backend_for

__all__ = ["Fit"]

_SUB = "tensorscope.fit"
_OPEN = OpenSteps()  # NOTE [an aborted step]: the fits with a step open, per thread


def _weak_pre(ref: weakref.ref[Fit]) -> Any:
    def call(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        fit = ref()
        if fit is not None:  # frame 2: torch's step() wrapper, which _step_hooks._run_pre called
            fit._before_step(optimizer, sys._getframe(2))

    return call


def _weak_post(ref: weakref.ref[Fit]) -> Any:
    def call(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        fit = ref()
        if fit is not None:
            fit._after_step(optimizer)

    return call


def _release(handles: tuple[Any, ...]) -> None:
    for handle in handles:
        handle.remove()


def _input_nbytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    total = 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            total += value.nbytes
        elif isinstance(value, (tuple, list)):
            total += sum(v.nbytes for v in value if isinstance(v, torch.Tensor))
    return total


class _Call:
    """One call of the model, from its forward pre-hook to its always_call forward hook."""

    __slots__ = ("frame", "returned", "step")

    def __init__(self, frame: FrameType) -> None:
        self.frame = frame  # torch's call of the forward: on the stack while it runs
        self.step: Step | None = None  # the step it is a training forward of
        self.returned = False


# NOTE [the budget on a caching allocator]
# On CUDA what runs out of memory is the caching allocator's reserved bytes, not the tensors'
# bytes the recording counts: blocks cached for reuse and fragmentation come on top. From the
# decided steps on the budget holds against reserved: the recorded step after a decision
# (steps 3, ...) resets the allocator's peaks at its start and reads them at its end; reserved
# above the budget is an excess like a measured one (_check: decided again with that much held
# back, twice at most). The first decision already keeps FRAGMENTATION_MARGIN of the budget
# back on such a device. Reserved falls only by empty_cache (which synchronises): ts.fit never
# calls it. Devices without a caching allocator (the CPU) report None and nothing changes.
FRAGMENTATION_MARGIN = 0.05

TIMED_BEFORE_CHECK = 2  # unrecorded steps under a decision timed before it is checked
WARMING_STEPS = 3  # compile=True: steps that may compile before one is recorded anyway
TIME_TOLERANCE = 0.10  # how far from the prediction they may be (NOTE [a prediction ...])
IMPLAUSIBLE_REST = 0.02  # a rest outside the chain below this share of the step: see there


def _same_choice(a: Decision, b: Decision) -> bool:
    x, y = a.chosen, b.chosen
    return (a.blocks, x.base.free_gradients, x.base.state_offloaded, x.base.placed_bytes) == (
        b.blocks,
        y.base.free_gradients,
        y.base.state_offloaded,
        y.base.placed_bytes,
    ) and (x.base.chunked_loss, x.chain_limit, x.offloaded) == (
        y.base.chunked_loss,
        y.chain_limit,
        y.offloaded,
    )


class Fit:
    """A model and its optimizer fitted into a byte budget; made by :func:`tensorscope.fit`.

    Attributes:
        model, optimizer: what was fitted.
        budget_bytes: the budget, in bytes.
        atomic: whether every step is atomic (``ts.fit(..., atomic=True)``).
        chain: the block chain (a :class:`~tensorscope.checkpoint.CheckpointedChain`), or None
            when the model has none (``chain_note`` says why).
        plan_before: the recorded first step (a :class:`~tensorscope.MemoryPlan`), once it ran.
        plan_after: a recorded step under the decision (the third step), once it ran.
        decision: the :class:`~tensorscope.fit.decide.Decision` in force, once taken.
        steps: optimizer steps seen (an aborted step does not count).
        removed: whether :meth:`remove` ran.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        budget: int,
        blocks: str | None,
        atomic: bool = False,
        ranks: Ranks | None = None,
        compiled: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.budget_bytes = budget
        self.atomic = atomic
        self.chain, self.chain_note = find_the_chain(model, blocks)
        self._offload = ActivationOffload()
        self._place = ParamPlacement(self.chain)
        self._states = OptimizerStates(atomic)
        self._loss = LossRouting()
        self._inb = InBackwardUpdates(self._states, self.chain)
        self._inb.on_late_reader = self._late_reader
        self._chunked = ChunkedLoss()
        self._recorder = StepRecorder()
        self._across = AcrossRanks(self.chain, self._states, self._place, ranks)
        self._compiled = CompiledRun(self.chain, compiled)
        # NOTE [fit as parts]: the order. Attached, decided and started top-down; detached,
        # aborted and forwards ended bottom-up.
        self._parts = Parts(
            [
                self._across,  # the ranks' agreement; FSDP2's sharded blocks (NOTE [a fit ...])
                self._offload,  # the offloader of the chain's blocks' saved tensors
                self._place,  # the chain's parameters in files between their uses
                ChainExecutor(self.chain, self._offload, self._place, self._across),
                self._compiled,  # compile=True: the blocks' and the model's forwards compiled
                self._states,  # optimizer state in the next tier between updates
                self._inb,  # updates inside backward (the store's rows)
                self._chunked,  # an HF causal LM's head and loss in row chunks, if decided
                self._loss,  # a large F.cross_entropy with its gradient in place
                self._recorder,  # the step recorded: opens after the others, closes first
            ]
        )
        self._decider = Decider(
            model,
            optimizer,
            budget,
            self.chain,
            self._offload,
            self._place,
            self._states,
            atomic,
            chunked=self._chunked,
        )
        self._decider.across = self._across
        self.optimizer_note = self._decider.optimizer_note
        self.plan_before: MemoryPlan | None = None
        self.plan_after: MemoryPlan | None = None
        self.decision: Decision | None = None
        self._decided: Decided | None = None  # the decision as the parts apply it
        self.grads_kept_because: list[str] = []
        self.steps = 0
        self.notes: list[str] = []
        self._phase = Phase.MEASURE
        self._step: Step | None = None
        self._error: ScheduleError | None = None
        self._batch_nbytes = 0
        self._after_at = 0
        self._times: list[float] = []
        self._timed_against = False  # NOTE [a prediction measured against]: done once
        # NOTE [the budget on a caching allocator]: (reserved, allocated) peaks of the recorded
        # step under the decision; Nones without a caching allocator
        self.allocator_peaks: tuple[int | None, int | None] = (None, None)
        self._margin_kept = False
        self._corrected_peak: int | None = None  # plan_after's peak, read-ahead and placement
        self._freed: Candidate | None = None  # atomic=True: the best plan freeing gradients
        self._local = threading.local()  # this thread's model calls (_Call), innermost last
        self._stepping: FrameType | None = None  # the user's optimizer.step() running now
        self._parts.attach(model, optimizer)
        # compiler-disabled: a compiled model breaks its graph around them, never traces a
        # fit's state (NOTE [compiled models and the chain], checkpoint/routes.py)
        disabled = compiler_disabled
        self._handles: list[RemovableHandle | Attached] = [
            model.register_forward_pre_hook(disabled(self._before), with_kwargs=True),
            model.register_forward_hook(disabled(self._returned)),
            model.register_forward_hook(disabled(self._after_forward), always_call=True),
        ]
        self._handles.append(leave_out_of_copies(model, list(self._handles)))  # _copies.py
        # global, after the recorder's (rank 0): torch runs an optimizer's own post hooks
        # before the global ones, and the recorder notes optimizer state in its hook
        ref = weakref.ref(self)
        steps = (
            _step_hooks.add_pre(_weak_pre(ref), rank=1),
            _step_hooks.add_post(_weak_post(ref), rank=1),
        )
        # a model dropped without remove(): its hooks go with it, and so do these
        assert self._recorder.hooks is not None  # attached
        self._finalizer = weakref.finalize(self, _release, (*steps, self._recorder.hooks))

    def _agreed_budget(self, budgets: list[int]) -> None:
        """Every rank's budget, given to ts.fit: each decides under the smallest
        (NOTE [one decision across ranks])."""
        self.budget_bytes = self._decider.budget = min(budgets)
        self._across.budgets = tuple(budgets)

    @property
    def removed(self) -> bool:
        """Whether :meth:`remove` ran."""
        return self._phase is Phase.REMOVED

    @property
    def loss_routed(self) -> int:
        """Cross-entropy calls routed to the in-place loss so far (fit/loss.py)."""
        return self._loss.routed

    @property
    def loss_shape(self) -> tuple[int, ...]:
        """The last routed loss's logits' shape."""
        return self._loss.shape

    # -- the step boundary (NOTE [the step boundary]) ------------------------------------------

    def _calls(self) -> list[_Call]:
        calls: list[_Call] | None = getattr(self._local, "calls", None)
        if calls is None:
            calls = self._local.calls = []
        return calls

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call, calls = _Call(caller_of_disabled()), self._calls()
        if calls:  # a BaseException skips the always_call hook: those calls do not run
            calls[:] = [c for c in calls if running(c.frame)]
        calls.append(call)  # first: the always_call hook pops it, whatever raises
        if self.removed:
            return
        self._abort_if_dead()  # this model's step, if a forward now means it is dead
        if not module.training or not torch.is_grad_enabled():
            return
        if self._error is not None:
            raise ScheduleError(str(self._error))
        _OPEN.abort_dead(but=self)  # another fit's dead step must not record this one's ops
        if self._step is None:
            grads = any(p.grad is not None for p in parameters_of(self.optimizer))
            # NOTE [a fit across ranks]: each step begins on every rank together
            begun = self._across.begin(_input_nbytes(args, kwargs), grads)
            if begun.departed:  # NOTE [a rank that removes its fit]: this step runs plain
                self._depart()
                return
            if begun.again and self.plan_before is not None and self.decision is not None:
                self.notes.append(f"step {self.steps + 1}: {begun.again}; decided again without")
                self.decision, self._decided = None, None
                self._apply(self.plan_before, not self.grads_kept_because)
            self._begin(begun.batch_nbytes, begun.grads)
        step = self._step
        assert step is not None  # _begin made it, or raised
        step.forwards += 1
        if step.forwards > 1 and not step.running and self._inb.updated_this_step:
            self._late_reader("a second forward before optimizer.step()", None, stacklevel=5)
        step.running.append(call.frame)
        call.step = step
        self._parts.forward_start(step)

    def _returned(self, module: nn.Module, args: Any, output: Any) -> None:
        calls = self._calls()
        if calls:
            calls[-1].returned = True

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        calls = self._calls()
        call = calls.pop() if calls else None
        step = call.step if call is not None else None
        if call is None or step is None or step is not self._step:
            return
        step.running.remove(call.frame)
        self._parts.forward_end(step)
        if not call.returned:  # an Exception left the forward (NOTE [an aborted step])
            self._abort("forward")
        elif not torch.compiler.is_compiling():
            watch_backward(step, output)

    def _begin(self, batch_nbytes: int, grads: bool) -> None:
        grown = self._phase is Phase.DECIDED and batch_nbytes > self._batch_nbytes
        self._phase = advance(self._phase, Event.REMEASURE if grown else Event.BEGIN)
        measured = self._phase.measuring
        step = Step(self.steps + 1, measured, measured, batch_nbytes, grads)
        if running(self._stepping):  # begun by a closure inside optimizer.step()
            step.stepping = self._stepping
        self._step = step
        _OPEN.opened(self)
        decision = self.decision
        if not measured and grads and decision is not None and decision.free_gradients:
            self._redecide(
                "gradients existed when a step began (accumulated across optimizer steps, or "
                "zero_grad(set_to_none=False)): they are the optimizer's input"
            )
        step.recorded = measured or (
            self.plan_after is None
            and self.steps >= self._after_at
            # NOTE [compile=True]: after a step that compiled nothing (or a few that kept on)
            and (not self._compiled.warming or self.steps >= self._after_at + WARMING_STEPS)
        )
        if step.recorded and not measured:  # NOTE [the budget on a caching allocator]
            self._device_backend().reset_allocator_peaks()
        self._parts.step_start(step)

    def _before_step(self, optimizer: torch.optim.Optimizer, frame: FrameType) -> None:
        if optimizer is not self.optimizer or self.removed or self._parts.stepping:
            return
        self._abort_if_dead()  # a backward that raised: this optimizer.step() is no step's
        self._stepping = frame  # a step begun inside it (a closure's forward) runs inside it
        if self._step is not None:
            self._step.stepping = frame

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.optimizer or self.removed or self._parts.stepping:
            return
        step, self._step = self._step, None
        self._stepping = None
        if step is not None:
            _OPEN.closed(self)
            step.stepping = None
            if self._phase is Phase.REMEASURING:
                self.notes.append(
                    f"step {step.number}: the batch grew ({format_bytes(self._batch_nbytes)} -> "
                    f"{format_bytes(step.batch_nbytes)} of inputs): measured and decided again"
                )
            self._phase = advance(self._phase, Event.END)
        self._parts.step_end(step)
        if step is None:
            return
        elapsed = time.perf_counter() - step.started
        self.steps += 1
        if step.measured:
            self._batch_nbytes = max(self._batch_nbytes, step.batch_nbytes)
        if self._states.failed_write() and self.plan_before is not None:
            # NOTE [a full disk] (statestore.py): the state stayed in memory this step
            if self._across.active:  # every rank decides again, at the next step's start
                self._across.want_again(self._states.off)
            else:
                self.notes.append(f"step {self.steps}: {self._states.off}; decided again without")
                self.decision, self._decided = None, None
                self._apply(self.plan_before, not self.grads_kept_because)
                return
        plan = self._recorder.plan
        if step.measured and plan is not None:
            self.plan_before = plan
            self._decide_now(step)
        elif step.recorded and plan is not None:
            self._measured_after(plan)
        elif not step.recorded and self.plan_after is not None:
            self._times.append(elapsed)
            if len(self._times) == TIMED_BEFORE_CHECK and not self._timed_against:
                self._against_prediction()

    # -- an aborted step (NOTE [an aborted step]) ----------------------------------------------

    def _abort_if_dead(self) -> None:
        """Abort the step in progress if an exception left it (NOTE [an aborted step])."""
        step = self._step
        what = dead(step) if step is not None else None
        if what is not None:
            self._abort(what)

    def _abort(self, what: str | None) -> None:
        """Abort the step in progress: every part back to where it began; ``what`` raised
        (None: dropped by remove(), nothing to say)."""
        step, self._step = self._step, None
        if step is None:
            return
        self._stepping = None
        _OPEN.closed(self)
        calls = self._calls()
        calls[:] = [c for c in calls if c.step is not step]  # forwards that never returned
        again = self._phase is Phase.REMEASURING and self._decided is not None
        self._phase = advance(self._phase, Event.ABORT)
        updated = self._parts.abort(step)
        if again and self._decided is not None:  # the measured step turned parts off
            self._parts.decide(self._decided)
        if what is None:
            return
        note = f"step {step.number}: aborted (an exception propagated out of its {what})"
        if updated:
            chain = self.chain
            blocks, path = (chain.blocks, chain.path) if chain is not None else ((), "")
            words = updated_words(self.model, updated, blocks, path)
            note += f"; {len(updated)} parameters were already updated in it: {words}"
            warn_updated(step.number, what, updated, words)
        self.notes.append(note)

    # -- deciding ----------------------------------------------------------------------------

    def _decide_now(self, step: Step) -> None:
        plan = self.plan_before
        if plan is None:  # pragma: no cover - called after a measuring step
            return
        self.grads_kept_because = self._decider.why_grads_kept(
            plan, step.forwards, step.grads_at_start
        )
        reserved, _ = self._device_backend().allocator_bytes()
        if reserved is not None and not self._margin_kept:  # NOTE [the budget on a caching ...]
            self._margin_kept = True
            margin = int(self.budget_bytes * FRAGMENTATION_MARGIN)
            self._decider.slack += margin
            self.notes.append(
                f"the device has a caching allocator: {format_bytes(margin)} of the budget "
                f"kept back for its cached blocks and fragmentation"
            )
        self._apply(plan, not self.grads_kept_because)
        if self.atomic and len(self.grads_kept_because) == 1:  # what atomic=True costs
            self._freed = self._decider.freed_alternative(plan)
        if plan.peak_bytes > self.budget_bytes:
            warnings.warn(
                f"{_SUB}: the measuring step (every block recomputed, gradients kept) held "
                f"{format_bytes(plan.peak_bytes)}, above the budget of "
                f"{format_bytes(self.budget_bytes)}; later steps run the decision, predicted "
                f"at {format_bytes(self._predicted_peak())}",
                FitWarning,
                stacklevel=3,
            )

    def _late_reader(self, what: str, gone: int | None, stacklevel: int = 4) -> None:
        """NOTE [a step that reads gradients after the recorded one] (fit/gradreaders.py)."""
        updated = self._inb.updated_this_step
        step = self._step.number if self._step is not None else self.steps + 1
        if gone is None:
            reason = (
                "gradient accumulation began after the recorded step (a second forward before "
                "optimizer.step())"
            )
            effect = (
                f"its backward had already applied {updated} parameters' updates inside "
                f"backward, so this micro-batch runs on updated weights and its gradients are "
                f"applied by optimizer.step() on their own"
            )
        else:
            reason = (
                f"{what} reads the gradients before optimizer.step() (not in the recorded step)"
            )
            effect = (
                f"{gone} of the gradients it was given were already applied and freed inside "
                f"backward, so it did not see them (nothing was clipped)"
            )
        self.notes.append(f"step {step}: {what}: {effect}; gradients kept from now on")
        warnings.warn(
            f"{_SUB}: step {step}: {what}, which the recorded step did not do: {effect}. This "
            f"step differs from the plain loop's; from now on gradients are kept until "
            f"optimizer.step() and every step is exact again. To keep every step exact, do in "
            f"the first step what later steps do (or use ts.fit(..., atomic=True))",
            FitWarning,
            stacklevel=stacklevel,  # the user's line: the reader's call, or the model's
        )
        self._redecide(reason)

    def _redecide(self, reason: str) -> None:
        if reason not in self.grads_kept_because:
            self.grads_kept_because.append(reason)
        if self.plan_before is not None:
            self._apply(self.plan_before, False)

    def _apply(self, plan: MemoryPlan, free_gradients: bool) -> None:
        try:
            decided = self._decider.decide(plan, free_gradients)
            # a part could not apply it (it says why): again without, on every rank
            while not self._across.all_applied(self._parts.decide(decided)):
                decided = self._decider.decide(plan, free_gradients)
        except ScheduleError as exc:
            self._error = exc
            self._phase = advance(self._phase, Event.FAIL)
            if self._step is not None:  # a decision taken again as a step began
                self._step = None
                _OPEN.closed(self)
            raise
        self.decision, self._decided = decided.decision, decided
        self._phase = advance(self._phase, Event.DECIDE)
        self._corrected_peak = None
        self._after_at = self.steps + 1  # step +1 re-times the chain; the next is recorded
        self.plan_after = None
        self._times = []

    def _device_backend(self) -> Backend:
        params = parameters_of(self.optimizer)
        return backend_for(params[0].device if params else torch.device("cpu"))

    def _measured_after(self, plan: MemoryPlan) -> None:
        """The recorded step under the decision: its peak corrected with what the parts held
        that the recording does not see as it was; a failed offload write: decided again."""
        self.plan_after = plan
        self.allocator_peaks = self._device_backend().allocator_peaks()
        opened = self._recorder.opened_at
        placed = self._place.names()
        held = [(t - opened, b) for t, b in self._place.take_log()]
        if placed:
            self._corrected_peak = placed_peak(plan, placed, held)
        offloader = self._offload.offloader
        if offloader is not None and self.chain is not None and self.chain.offloaded:
            log = [(t - opened, b) for t, b in self._offload.take_log()]
            paths = self._decider.chain_paths(plan)
            backward = chain_backward_peak(plan, paths, log, placed=placed, held=held)
            whole = self._corrected_peak
            self._corrected_peak = max(whole if whole is not None else plan.peak_bytes, backward)
            stats = offloader.stats()
            if stats.write_errors and self.plan_before is not None:
                self._offload.off = (
                    f"writing activations to the {stats.tier} tier failed: {stats.last_error}"
                )
                warnings.warn(
                    f"{_SUB}: {stats.write_errors} offloaded activations could not be "
                    f"written to the {stats.tier} tier ({stats.last_error}); they stayed "
                    f"in memory (nothing is lost); deciding again without offload",
                    FitWarning,
                    stacklevel=3,
                )
                if not self._across.active:
                    self._apply(self.plan_before, self._frees())
                    return
                # every rank decides again at the next step's start; the check agrees now
                self._across.want_again(self._offload.off)
        self._check(plan)

    # NOTE [a prediction measured against]
    # The decision's predicted step time is the chain's schedule (its blocks timed in the step
    # after the decision) plus the rest of the step as step 1 took it while it was recorded --
    # and recording slows small ops, so the rest is often overestimated (measured 0.97 s against
    # a predicted 1.17 s on GPT-2 8x256). Once, after the first TIMED_BEFORE_CHECK unrecorded
    # steps under the decision, their median is set against the prediction: more than
    # TIME_TOLERANCE off, the decision is taken again with the error put where it most likely
    # is: a step slower than predicted with blocks offloaded, on the offload's writes and reads
    # (the next tier's bandwidth was measured alone, not beside compute: 1.85 s against 1.43 s
    # predicted, GPT-2 8x256 with six blocks offloaded to the disk tier); otherwise on the rest
    # of the step, scaled to what was measured (the chain's part as predicted from its re-timed
    # blocks). A
    # different choice is applied (its chain re-timed, its next step recorded, as after any
    # decision); the same one keeps running, its prediction corrected. explain() shows both.
    # Where the chain alone is predicted to take the whole measured step or more, its blocks'
    # times were too high (the measuring step's tracked times, or a slow re-timing step in a
    # fresh process), not the rest (GPT-2 8x256: the rest scaled to its floor, x0.02): the
    # whole step is re-timed, blocks and rest alike -- the same choice, the prediction
    # corrected. Not done: taking the decision again on the re-timed blocks as soon as they
    # are re-timed -- tried: one slow re-timing step (2.1 s against 1.3 s later) inflated every
    # compute time but not the offload's I/O, and the decision switched to offloading six
    # blocks (GPT-2 8x256 at 440 MiB: 1.78x plain, against 1.20x recomputing).

    def _against_prediction(self) -> None:
        self._timed_against = True
        decision, plan = self.decision, self.plan_before
        if decision is None or plan is None:
            return
        chosen = decision.chosen
        measured = statistics.median(self._times)
        predicted = chosen.predicted_s
        if predicted <= 0 or abs(measured - predicted) <= TIME_TOLERANCE * predicted:
            return
        decider, chain = self._decider, self.chain
        profile = chain.profile if chain is not None else None
        offload = self._decided.offload if self._decided is not None else None
        io_s = sum(offload.seconds[k] for k in chosen.offloaded) if offload is not None else 0.0
        scales = (decider.outside_scale, decider.offload_scale)
        if measured > predicted and io_s > 0:  # slower with blocks offloaded: their I/O
            decider.offload_scale *= (io_s + measured - predicted) / io_s
            what = f"the offload's writes and reads re-timed x{decider.offload_scale:.2f}"
        else:
            recorded_rest = chosen.base.seconds / decider.outside_scale
            rest = measured - (predicted - chosen.base.seconds)
            if recorded_rest <= 0:
                return
            if rest < IMPLAUSIBLE_REST * measured and chain is not None and profile:
                # the chain alone was predicted to take the whole step or more: its
                # blocks were re-timed in a slow step (step 2 of a fresh process: the allocator
                # still growing), so the step is re-timed as a whole -- the same choice, the
                # prediction corrected (before: the rest scaled to its floor, x0.02)
                ratio = measured / predicted
                chain.profile = retimed(
                    profile,
                    {k: p.fw_s * ratio for k, p in enumerate(profile.layers)},
                    {k: p.bw_s * ratio for k, p in enumerate(profile.layers)},
                )
                decider.outside_scale *= ratio
                what = f"the whole step re-timed x{ratio:.2f} (the chain's blocks and the rest)"
            else:
                decider.outside_scale = min(50.0, max(0.02, rest / recorded_rest))
                what = (
                    "the rest of the step (outside the chain) re-timed "
                    f"x{decider.outside_scale:.2f}"
                )
        try:
            decided = self._decider.decide(plan, self._frees())
        except ScheduleError:
            decider.outside_scale, decider.offload_scale = scales
            if chain is not None:
                chain.profile = profile
            return
        again = decided.decision.chosen
        note = (
            f"step {self.steps}: measured {measured:.3f} s a step against the predicted "
            f"{predicted:.3f} s ({(measured / predicted - 1) * 100:+.0f}%): {what} and the "
            f"decision taken again, predicted now {again.predicted_s:.3f} s"
        )
        if _same_choice(decision, decided.decision):
            self.notes.append(note + " (the same choice)")
            self.decision, self._decided = decided.decision, decided
            return
        self.notes.append(note + f": {', '.join(decided.decision.blocks) or 'changed'}")
        self._apply(plan, self._frees())

    def _frees(self) -> bool:
        return self.decision is not None and self.decision.free_gradients

    def _predicted_peak(self) -> int:
        return self.decision.chosen.predicted_peak if self.decision is not None else 0

    def _check(self, plan: MemoryPlan) -> None:
        # with blocks offloaded, what the offloader held read back ahead of use counts too
        # (the recording sees such a tensor from its use on): measured_peak adds it op by op
        held = self.measured_peak(plan)
        reserved = self.allocator_peaks[0] if plan is self.plan_after else None
        what = format_bytes(held)
        if reserved is not None and reserved > held:  # NOTE [the budget on a caching allocator]
            held, what = reserved, f"{format_bytes(reserved)} reserved by the caching allocator"
        excess = self._across.most_excess(held - self.budget_bytes)  # the ranks' largest
        if excess <= 0 or self.plan_before is None:
            return
        decider = self._decider
        decider.retries += 1
        again = decider.retries <= 2
        warnings.warn(
            f"{_SUB}: step {self.steps} held {what}, "
            f"{format_bytes(excess)} above the budget of {format_bytes(self.budget_bytes)} "
            f"(predicted {format_bytes(self._predicted_peak())})"
            + ("; deciding again with that much less for the chain" if again else ""),
            FitWarning,
            stacklevel=3,
        )
        if again:
            decider.slack += excess
            self.notes.append(
                f"step {self.steps}: measured {format_bytes(excess)} above the budget; "
                f"decided again with {format_bytes(decider.slack)} held back"
            )
            self._apply(self.plan_before, self._frees())

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
        and step time, what an aborted step leaves. See docs/fit.md for a real one.

        Example:
            >>> import torch, tensorscope as ts
            >>> net = torch.nn.Linear(4, 4)
            >>> fit = ts.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), budget="1MiB")
            >>> print(fit.explain().splitlines()[1])
              not measured yet: the first training step is recorded, then the plan is decided
            >>> fit.remove()
        """
        self._abort_if_dead()
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
                state_where=state_where(self.optimizer, self.decision, self._place, self._states),
                loss_shape=self.loss_shape if self.loss_routed else None,
                chunk_rows=self._chunked.rows(),
                chunk_why_not=self._chunked.why_not,
                notes=tuple(self.notes),
                error=str(self._error) if self._error is not None else None,
                removed=self.removed,
                offload_tier=None if self._offload.off else self._offload.tier,
                offload_why_not=offload_why_not(
                    self.optimizer, chain, self._offload.off or self._states.off
                ),
                offload_read_ahead=self._offload.read_ahead,
                measured_peak=self.measured_peak(self.plan_after) if self.plan_after else 0,
                allocator_peaks=self.allocator_peaks,
                atomic=self.atomic,
                stepwise=self._states.store is not None and self._states.store.stepwise,
                freed=self._freed,
                compile_lines=tuple(self._compiled.lines()),
                across=tuple(self._across.lines()),
            )
        )

    def _depart(self) -> None:
        """Another rank removed its fit (NOTE [a rank that removes its fit]): so does this."""
        self._across.departed = True
        warnings.warn(
            f"{_SUB}: another rank removed its fit; this rank's fit of "
            f"{type(self.model).__name__} is removed too (every rank runs the same steps), and "
            f"the model trains without it from this step on",
            FitWarning,
            stacklevel=4,
        )
        self.remove()

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
        self._abort_if_dead()
        self._abort(None)  # a step in progress is dropped
        self._phase = advance(self._phase, Event.REMOVE)
        self._across.depart(self.model)  # NOTE [a rank that removes its fit]
        while self._handles:
            self._handles.pop().remove()
        try:
            self._parts.detach()
        finally:
            self._finalizer()  # the global step hooks and the recorder's hooks, once
            fitted.release(self, (self.model, self.optimizer))

    def __repr__(self) -> str:
        return (
            f"<Fit {type(self.model).__name__} + {type(self.optimizer).__name__}, budget "
            f"{format_bytes(self.budget_bytes)}, {self.steps} steps, {self._phase.value}>"
        )
