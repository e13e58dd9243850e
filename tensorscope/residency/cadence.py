"""When the policy decides: after every op, or at the recorded iteration's decision points.

# NOTE [coarse decisions]
# Flow's decision after an op (which placements to prefetch, which to demote for them) costs
# Python time per op: a snapshot of what is resident and upcoming, the window, the actions.
# While every placement is on the device it decides nothing, and the C++ op path skips it
# (native.py). When weights stream (a budget below the model), deciding after each of a
# decode step's ops costs more than the step itself (Llama 8x512 `generate()` at 50%: 2128
# managed ops per call, all in Python). While the previous iteration predicts this one, Flow
# decides only at *decision points*: op indices that cut the recorded iteration into stretches
# of about an eighth of the budget of tensors first used there (graph/analysis.py
# ``decision_points``). At a point it asks for everything used up to the point after the next
# one (``Snapshot.horizon``), so a stretch's weights are on their way a stretch ahead. Between
# points an op whose operands are resident runs with no decision (on the C++ fast path with the
# C++ engine: ``native.quiet``); an op that finds an operand off the device decides at once, as
# does every op while nothing is predicted, and with any other policy, or Flow with a fixed
# ``prefetch_limit`` (the user asked for that depth after each op). Both engines decide at the
# same ops: a point is a clock value, and the fast path's ops advance the clock on replay.
#
# A decision at a point is also remembered: the same point of a later iteration, in the same
# state (the same placements resident, the same device bytes counted, the same operands, the
# disk's read rate within a factor of two), applies the same actions without a snapshot or a
# call to Flow. Flow keeps no state of its own; its answer depends on that snapshot, and on the
# pace where the disk is slow: then the measured read rate and compute time ask for more than
# the horizon, and for more or less from one iteration to the next. Such a decision is made
# afresh each time; only one that asks for no more than the horizon (or, with nothing due
# there, for the next placement only: what Flow asks for at any pace) is remembered. Apply
# checks each action against the budget and the pins, as ever.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Hashable

from tensorscope.graph.analysis import NextUse, decision_points
from tensorscope.graph.record import Recorder
from tensorscope.policies import Action, Flow, Policy, Snapshot
from tensorscope.policies.flow import due_count
from tensorscope.residency import native
from tensorscope.residency.ledger import Ledger

__all__ = ["Cadence"]

# A stretch between two decision points: this share of the budget, in tensors first used there.
_STRETCH_SHARE = 8
# Decisions remembered per decision point at most (one state each): a bound, not a tuning.
_PLANS_PER_POINT = 4

DecisionKey = tuple[int, int, int, tuple[int, ...], int]


class Cadence:
    """The manager's decision points (see the NOTE above); one per manager."""

    def __init__(self) -> None:
        self.decide_at = 0  # the manager clock of the next op that decides
        self._trace: NextUse | None = None
        self._points: list[int] = []
        self._plans: dict[DecisionKey, list[Action]] = {}

    def coarse(self, policy: Policy, budget: int | None, recorder: Recorder) -> bool:
        """Whether decisions wait for the next point (the NOTE's conditions)."""
        return (
            budget is not None
            and type(policy) is Flow
            and policy.prefetch_limit is None
            and recorder.predicting
        )

    def skips(self, clock: int, moved: bool) -> bool:
        """Whether the op at ``clock`` (in coarse mode) runs without a decision."""
        return not moved and clock < self.decide_at

    def decided(self, recorder: Recorder, ledger: Ledger, budget: int, clock: int) -> int:
        """A decision is made after the op at ``clock``: sets the next point and returns the
        horizon (the op index up to which the decision asks for placements)."""
        trace = recorder.previous
        assert trace is not None  # coarse() holds
        if trace is not self._trace and (self._trace is None or trace.ops != self._trace.ops):
            by_role = ledger.by_role

            def nbytes(role: Hashable) -> int:
                placement = by_role.get(role)
                return 0 if placement is None else placement.nbytes

            self._points = decision_points(trace.ops, nbytes, max(1, budget // _STRETCH_SHARE))
            self._plans.clear()
        self._trace = trace  # an iteration like the last one keeps its points and plans
        points, length, position = self._points, len(trace), recorder.position
        index = bisect_right(points, position)
        if index < len(points):
            self.decide_at = clock + points[index] - position
        else:  # the next iteration's first point (index 0)
            self.decide_at = clock + length - position + (points[0] if points else 0)
        self.passed(clock)
        return points[index + 1] if index + 1 < len(points) else length

    @staticmethod
    def key(
        position: int, ledger: Ledger, busy: tuple[int, ...], read_rate: float | None
    ) -> DecisionKey:
        """What a coarse decision at op ``position`` of the iteration depends on (the NOTE)."""
        rate = -1 if not read_rate or read_rate <= 0 else int(math.log2(read_rate))
        return (position, ledger.resident_print, ledger.device_total, busy, rate)

    def recall(self, key: DecisionKey) -> list[Action] | None:
        """The actions decided before in the state ``key``, or None."""
        return self._plans.get(key)

    def remember(self, key: DecisionKey, actions: list[Action], snapshot: Snapshot) -> None:
        """Keep ``actions`` for ``key`` unless the pace chose some of them (the NOTE)."""
        asked = {e.key for e in snapshot.upcoming[: max(due_count(snapshot), 1)]}
        if any(a.kind == "prefetch" and a.key not in asked for a in actions):
            return
        plans = self._plans
        if len(plans) >= _PLANS_PER_POINT * max(1, len(self._points)):
            plans.clear()  # states that do not repeat: start over rather than grow
        plans[key] = actions

    def passed(self, clock: int) -> None:
        """The op at ``clock`` ran in Python: the C++ fast path may run the ops left before
        the next point (it counts only the ops it runs)."""
        native.quiet(self.decide_at - clock - 1)

    def every_op(self) -> None:
        """Decisions after every op again (nothing predicted, another policy or budget)."""
        self.decide_at = 0
        self._trace = None  # the points depend on the budget and the sizes
        self._plans.clear()
        native.quiet(0)
