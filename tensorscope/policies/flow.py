"""Flow: keep what is hot on the device under the budget, evict what is used farthest in the
future, prefetch what comes next.

Next uses are predicted from the previous iteration (recorded op by op, as DeepSpeed ZeRO-3
records module order on its first step). Before one is recorded, the manager guesses them from
the order ``ts.manage()`` met the weights (``graph/order.py``): the weights after the last one
used come next, those used already are not needed again. Prefetching takes free headroom first,
then evicts only placements whose next use is farther than the prefetched one's (Belady's rule),
so a prefetch never pushes out something needed sooner; with no next use known, the least
recently used placement goes first.
"""

from __future__ import annotations

from tensorscope.errors import ArgumentTypeError, InvalidArgumentError
from tensorscope.policies.base import Action, Entry, OpView, Snapshot, take_until

__all__ = ["Flow"]

_NEVER = 1 << 62
# Placements prefetched after one op while nothing is measured yet (see ``Flow``).
_UNMEASURED_DEPTH = 4
# A placement is asked for now when the disk would need at least this share of the compute time
# until its use to deliver it and everything queued before it: reads are no steadier than that.
_SAFETY = 2.0


def _distance(entry: Entry) -> int:
    return _NEVER if entry.next_use is None else entry.next_use


def due_count(snapshot: Snapshot) -> int:
    """How many of ``snapshot.upcoming`` are used up to its horizon: before the manager decides
    again (residency/cadence.py), so Flow asks for them at any pace."""
    horizon = snapshot.horizon
    upcoming = snapshot.upcoming
    due = 0
    if horizon is not None:
        while due < len(upcoming) and _distance(upcoming[due]) <= horizon:
            due += 1
    return due


class Flow:
    """Belady eviction with the previous iteration as the oracle, plus prefetching.

    Args:
        prefetch_limit: how far ahead to prefetch. ``None`` (the default): as far as the
            measured pace says. Upcoming placements are taken in order of next use while the
            disk, at its measured read rate, would need more than half the compute time left
            until a placement's use to deliver it and everything before it: those must be
            asked for now (within the budget, by Belady's rule). A disk-bound model prefetches
            as far ahead as the budget allows, a compute-bound one (or a warm page cache) only
            what is needed next. Until a read rate and an iteration's pace are measured, 4
            placements. An int: exactly that many placements after each op (``0``: no
            prefetching at all).

    Example:
        >>> from tensorscope.policies.base import Entry, Snapshot
        >>> snap = Snapshot(100, 100, 5, (Entry(1, 50, "device", 4, 9, False),
        ...                                 Entry(2, 50, "device", 3, 6, False)))
        >>> Flow().evict(snap, 50)  # key 1 is needed later than key 2
        [1]
    """

    name = "flow"
    wants_snapshot_after_op = True

    def __init__(self, prefetch_limit: int | None = None) -> None:
        if prefetch_limit is not None and (
            isinstance(prefetch_limit, bool) or not isinstance(prefetch_limit, int)
        ):
            raise ArgumentTypeError(
                "tensorscope.residency: Flow(prefetch_limit=...) takes None (follow the "
                "measured pace) or an int (placements prefetched after one op, 0 for none); got "
                f"{type(prefetch_limit).__name__}."
            )
        if prefetch_limit is not None and prefetch_limit < 0:
            raise InvalidArgumentError(
                f"tensorscope.residency: Flow(prefetch_limit={prefetch_limit}) must be 0 or "
                "more (0 turns prefetching off), or None to follow the measured pace."
            )
        self.prefetch_limit = prefetch_limit

    def window(self, snapshot: Snapshot) -> tuple[Entry, ...]:
        """The upcoming placements to ask for after this op (see the class docstring).

        Example (the disk reads 100 bytes/s; compute reaches the third placement in 10 s,
        while the disk would need 1.5 s for all three: the third can wait):
            >>> from tensorscope.policies.base import Entry, Snapshot
            >>> up = tuple(Entry(k, 50, "disk", -1, k, False, eta) for k, eta in
            ...            [(1, 0.1), (2, 0.5), (3, 10.0)])
            >>> [e.key for e in Flow().window(Snapshot(1000, 0, 0, (), up, read_rate=100.0))]
            [1, 2]
        """
        upcoming = snapshot.upcoming
        if self.prefetch_limit is not None:
            return upcoming[: self.prefetch_limit]
        due = due_count(snapshot)  # asked for now, whatever the pace
        rate = snapshot.read_rate
        if rate is None or not upcoming or any(e.eta is None for e in upcoming):
            return upcoming[: max(due, _UNMEASURED_DEPTH)]
        queued = 0
        for index, entry in enumerate(upcoming):
            queued += entry.nbytes
            eta = entry.eta if entry.eta is not None else 0.0
            if index > 0 and _SAFETY * queued / rate < eta:
                return upcoming[: max(due, index)]
        return upcoming

    def _ranked_victims(self, entries: tuple[Entry, ...]) -> list[Entry]:
        idle = [e for e in entries if not e.busy]
        # Farthest next use first; among unknown/equal, least recently used first.
        idle.sort(key=lambda e: (-_distance(e), e.last_use))
        return idle

    def evict(self, snapshot: Snapshot, needed_bytes: int) -> list[int]:
        return take_until(self._ranked_victims(snapshot.entries), needed_bytes)

    def after_op(self, op: OpView) -> list[Action]:
        snapshot = op.snapshot
        if snapshot is None or not snapshot.upcoming:
            return []
        actions: list[Action] = []
        headroom = snapshot.headroom_bytes
        victims: list[Entry] | None = None  # ranked only if a prefetch needs room
        evicted: set[int] = set()
        window = self.window(snapshot)
        for candidate in window:
            if headroom is None or candidate.nbytes <= headroom:
                actions.append(Action("prefetch", candidate.key))
                if headroom is not None:
                    headroom -= candidate.nbytes
                continue
            # Make room only from placements needed after the candidate.
            if victims is None:
                victims = self._ranked_victims(snapshot.entries)
            plan, freed = [], 0
            for victim in victims:
                if victim.key in evicted:
                    continue
                if _distance(victim) <= _distance(candidate):
                    break
                plan.append(victim)
                freed += victim.nbytes
                if headroom + freed >= candidate.nbytes:
                    break
            if headroom + freed < candidate.nbytes:
                break  # the rest of the window is needed later still: stop here
            for victim in plan:
                evicted.add(victim.key)
                actions.append(Action("demote", victim.key))
            headroom += freed - candidate.nbytes
            actions.append(Action("prefetch", candidate.key))
        return actions

    def __repr__(self) -> str:
        return f"Flow(prefetch_limit={self.prefetch_limit})"
