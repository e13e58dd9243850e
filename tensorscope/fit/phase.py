"""Where a fit is in its life, and every way it moves: one table (pure: no torch).

# NOTE [steps of a fit]
#   MEASURE    (before step 1; again after a larger batch): the next step is measured -- recorded
#              as plan_before, the chain runs every block checkpointed and measures itself,
#              gradients are kept. At its END the decision is taken (DECIDE), or no plan fits
#              (FAIL): the ScheduleError is raised from optimizer.step() and again at every
#              later training forward (nothing runs past a budget it cannot meet).
#   DECIDED    a decision is in force. The first step under it re-times the chain
#              (CheckpointedChain), the second is recorded as plan_after: its peak is the
#              measured one; above the budget, the excess is taken off the chain's share and the
#              decision is taken again (DECIDE, a FitWarning). Later steps are timed.
#   MEASURING, RUNNING: a step of either kind is in progress (BEGIN at the model's first
#              training forward after the last optimizer.step(), END when optimizer.step()
#              returns). A decision may be taken again inside a step (gradients existed when it
#              began: they are the optimizer's input).
#   REMEASURING a measured step begun under a decision (REMEASURE: its batch is larger than any
#              measured); aborted, the decision is in force again.
#   ABORT      an exception propagated out of the step's forward, backward or optimizer.step()
#              (NOTE [an aborted step], abort.py): back to where the step began, as if it had
#              not started.
#   REMOVED    remove() ran; nothing moves any more.
"""

from __future__ import annotations

import enum

__all__ = ["TRANSITIONS", "Event", "Phase", "advance"]


class Phase(enum.Enum):
    """Where a fit is (NOTE [steps of a fit])."""

    MEASURE = "measure"
    MEASURING = "measuring"
    REMEASURING = "remeasuring"
    DECIDED = "decided"
    RUNNING = "running"
    FAILED = "failed"
    REMOVED = "removed"

    @property
    def measuring(self) -> bool:
        """Whether a measured step is in progress."""
        return self in (Phase.MEASURING, Phase.REMEASURING)


class Event(enum.Enum):
    """What moves a fit (NOTE [steps of a fit])."""

    BEGIN = "begin"  # the model's first training forward after the last optimizer.step()
    END = "end"  # optimizer.step() returned
    ABORT = "abort"  # an exception propagated out of the step
    DECIDE = "decide"  # a decision was applied (at a measured step's end, or again)
    FAIL = "fail"  # no plan fits the budget
    REMEASURE = "remeasure"  # a step begins with a larger batch than any measured
    REMOVE = "remove"  # remove()


_P, _E = Phase, Event
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (_P.MEASURE, _E.BEGIN): _P.MEASURING,
    (_P.MEASURE, _E.DECIDE): _P.DECIDED,
    (_P.MEASURE, _E.FAIL): _P.FAILED,
    (_P.MEASURING, _E.END): _P.MEASURE,  # then DECIDE or FAIL, or measure again (no plan)
    (_P.MEASURING, _E.ABORT): _P.MEASURE,
    (_P.DECIDED, _E.BEGIN): _P.RUNNING,
    (_P.DECIDED, _E.DECIDE): _P.DECIDED,  # a measured excess, a failed write: decided again
    (_P.DECIDED, _E.FAIL): _P.FAILED,
    (_P.DECIDED, _E.REMEASURE): _P.REMEASURING,
    (_P.REMEASURING, _E.END): _P.MEASURE,  # then DECIDE or FAIL, as a measured step
    (_P.REMEASURING, _E.ABORT): _P.DECIDED,
    (_P.RUNNING, _E.END): _P.DECIDED,
    (_P.RUNNING, _E.ABORT): _P.DECIDED,
    (_P.RUNNING, _E.DECIDE): _P.RUNNING,  # gradients existed when the step began
    (_P.RUNNING, _E.FAIL): _P.FAILED,
    **{(phase, _E.REMOVE): _P.REMOVED for phase in Phase},
}


def advance(phase: Phase, event: Event) -> Phase:
    """The phase after ``event``.

    Raises:
        RuntimeError: ``event`` cannot happen in ``phase`` (a bug in ts.fit, not a user error).

    Example:
        >>> advance(Phase.MEASURE, Event.BEGIN)
        <Phase.MEASURING: 'measuring'>
        >>> advance(Phase.RUNNING, Event.ABORT)
        <Phase.DECIDED: 'decided'>
    """
    after = TRANSITIONS.get((phase, event))
    if after is None:
        raise RuntimeError(f"tensorscope.fit: internal error: {event.value} while {phase.value}")
    return after
