"""How ops on managed tensors are counted into the manager's state: one at a time (the Python
op path, oppath.py) or a log of them at once (the C++ fast path's, replayed: native.py).

Counting an op: the manager's clock advances by one; every ``SWEEP_EVERY`` ops a sweep forgets
the placements nothing holds any more; the thread's recorder traces the op (its operands'
roles, when it began), and an op that begins a new iteration (a repeated forward) ends the
previous one (``iteration_end``: the module order restarts, a sweep); the module order
advances over the op's roles; each operand's last use becomes the op's clock.

# NOTE [one count, two speeds]
# The fast path runs ops with no Python and logs them; the replay must leave the ledger as
# counting them one by one would have. It cannot simply call the per-op count for each (that
# was 2.9 µs an op; in bulk 1.2: docs/design.md §14), so both are written here, side by side:
# the recorder traces a stretch at once (``Recorder.record_many`` finds the iteration starts as
# ``record`` does), the module order's cursor advances once per stretch (it only moves forward
# within an iteration), last uses come from the log (the engine finds each uid's last op), and
# the sweeps that would have run at each ``SWEEP_EVERY`` are one sweep at the end (a sweep
# forgets what nothing holds then, which includes what those would have forgotten).
# tests/residency/test_tally.py drives both with the same ops and compares what they leave.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

from tensorscope.graph.order import ModuleOrder
from tensorscope.graph.record import Recorder

if TYPE_CHECKING:
    from tensorscope.residency.placement import Placement

__all__ = ["SWEEP_EVERY", "Tally"]

SWEEP_EVERY = 64  # ops between sweeps of placements nothing else holds any more


class Tally:
    """The clock and the sweep count of the manager's ops, and the rules that advance them.

    ``sweep`` and ``iteration_end`` are the manager's (a sweep calls ``swept()`` back)."""

    def __init__(self, sweep: Callable[[], None], iteration_end: Callable[[], None]) -> None:
        self.clock = 0  # ops counted so far (the policy's and the ledger's time)
        self.since_sweep = 0
        self._sweep = sweep
        self._iteration_end = iteration_end

    def swept(self) -> None:
        """A sweep ran (for any reason): the next is due ``SWEEP_EVERY`` ops from now."""
        self.since_sweep = 0

    # ------------------------------------------------------------------------- one at a time
    def tick(self) -> None:
        """An op begins: the clock advances, a sweep runs when one is due."""
        self.clock += 1
        self.since_sweep += 1
        if self.since_sweep >= SWEEP_EVERY:
            self._sweep()

    def record(
        self,
        recorder: Recorder,
        order: ModuleOrder,
        func: Any,
        roles: tuple[Hashable, ...],
        at: float,
    ) -> None:
        """The op, its operands resident, is traced (``at``: when it began)."""
        iterations = recorder.iterations
        recorder.record(func, roles, at)
        if recorder.iterations != iterations:
            self._iteration_end()  # a repeated forward began a new iteration
        order.advance(roles)  # kept current: a trace may diverge at any op

    def used(self, placements: Iterable[Placement]) -> None:
        """The op ran: its operands were last used now."""
        clock = self.clock
        for placement in placements:
            placement.last_use = clock

    # ------------------------------------------------------------------------------ in bulk
    def replay(
        self,
        recorder: Recorder,
        order: ModuleOrder,
        by_uid: dict[int, Placement],
        log: tuple[list[Any], list[tuple[int, ...]], list[float], dict[int, int]],
        stalled: float = 0.0,
    ) -> None:
        """Count the ops of a fast path's log (``_layout.LOG``: ops, each op's operand uids,
        when each began, each uid's last op) as ``tick``, ``record`` and ``used`` would have,
        op by op (NOTE [one count, two speeds]); ``stalled``: seconds to add to the times."""
        funcs, uids, clocks, last = log
        # Roles resolved first (a sweep while replaying may forget a placement used later),
        # once per distinct operand tuple (the engine gives equal tuples as one object).
        roles_of: dict[int, tuple[Hashable, ...]] = {}
        for operands in uids:
            if id(operands) not in roles_of:
                roles_of[id(operands)] = tuple(by_uid[u].role for u in operands if u in by_uid)
        roles = [roles_of[id(operands)] for operands in uids]
        times = [at + stalled for at in clocks] if stalled else clocks
        starts = recorder.record_many(funcs, roles, times)
        count = len(roles)
        since = self.since_sweep
        sweep_due = False
        begin = 0
        for cut in [*starts, count]:
            if cut > begin:
                order.advance({r for op in roles[begin:cut] for r in op})
                counted = cut - begin
                if begin in starts:  # that op's iteration_end() swept
                    since, counted = 0, counted - 1
                sweep_due = sweep_due or since + counted >= SWEEP_EVERY
                since = (since + counted) % SWEEP_EVERY
            if cut < count:
                self._iteration_end()  # the op at `cut` began a new iteration
            begin = cut
        clock = self.clock
        for uid, index in last.items():
            placement = by_uid.get(uid)
            if placement is not None:
                placement.last_use = clock + index + 1
        self.clock = clock + count
        if sweep_due:
            self._sweep()
        self.since_sweep = since
