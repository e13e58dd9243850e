"""The policy protocol: pure decisions over an immutable snapshot; the manager applies them.

A policy never touches tensors, tiers or locks. Before an op whose operands do not fit, the
manager asks :meth:`Policy.evict` which device-resident placements to demote; after every op
it asks :meth:`Policy.after_op` for demotions and prefetches. Keys are placement ids.

Example (a policy that never keeps anything it does not need right now):
    >>> class Stingy:
    ...     name = "stingy"
    ...     wants_snapshot_after_op = False
    ...     def evict(self, snapshot, needed_bytes):
    ...         return [e.key for e in snapshot.entries if not e.busy]
    ...     def after_op(self, op):
    ...         return [Action("demote", k) for k in op.operands + op.results]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple, Protocol, runtime_checkable

__all__ = ["Action", "Entry", "OpView", "Policy", "Snapshot", "take_until"]


class Entry(NamedTuple):
    """One managed placement as the policy sees it (a NamedTuple: built per op, cheaply)."""

    key: int
    nbytes: int
    tier: str  # "device" | "host" | "disk"
    last_use: int  # manager clock (ops) of its last use; -1 if never used
    next_use: int | None  # predicted op index of its next use in this iteration; None: unknown
    busy: bool  # an operand of the op in flight: must stay on the device
    # Seconds of compute until its next use (the previous iteration's pace); None: unknown.
    eta: float | None = None


def take_until(ranked: Iterable[Entry], needed_bytes: int) -> list[int]:
    """Keys of ``ranked`` entries, in order, until they add up to ``needed_bytes``.

    Example:
        >>> take_until([Entry(1, 40, "device", 0, None, False), Entry(2, 40, "device", 0, None,
        ...             False)], 50)
        [1, 2]
    """
    chosen, freed = [], 0
    for entry in ranked:
        if freed >= needed_bytes:
            break
        chosen.append(entry.key)
        freed += entry.nbytes
    return chosen


class Snapshot:
    """The state a decision may depend on; ``entries`` are the device-resident placements.

    Immutable for the policy. ``entries`` may be built on first access (``make_entries``): a
    policy that decides without them costs no per-placement work.
    """

    __slots__ = (
        "_entries",
        "_make",
        "budget_bytes",
        "clock",
        "device_bytes",
        "horizon",
        "read_rate",
        "upcoming",
    )

    def __init__(
        self,
        budget_bytes: int | None,
        device_bytes: int,
        clock: int,
        entries: tuple[Entry, ...] | None = None,
        upcoming: tuple[Entry, ...] = (),
        *,
        make_entries: Callable[[], tuple[Entry, ...]] | None = None,
        read_rate: float | None = None,
        horizon: int | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.device_bytes = device_bytes
        self.clock = clock
        # Placements the previous iteration used next (not resident), nearest first.
        self.upcoming = upcoming
        self._entries = entries
        self._make = make_entries
        # Bytes per second the disk tier delivers (measured); None until measured.
        self.read_rate = read_rate
        # The manager decides next only after some ops (residency/cadence.py): what is used
        # up to this op index must be asked for now. None: a decision comes after every op.
        self.horizon = horizon

    @property
    def entries(self) -> tuple[Entry, ...]:
        if self._entries is None:
            self._entries = self._make() if self._make is not None else ()
        return self._entries

    @property
    def headroom_bytes(self) -> int | None:
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.device_bytes


class OpView(NamedTuple):
    """The op that just ran: its managed operands and results (keys)."""

    name: str
    operands: tuple[int, ...]
    results: tuple[int, ...]
    snapshot: Snapshot | None = None  # present when the policy asks for it


class Action(NamedTuple):
    """``demote`` a placement to the next lower tier, or ``prefetch`` it onto the device."""

    kind: Literal["demote", "prefetch"]
    key: int


@runtime_checkable
class Policy(Protocol):
    """What the residency manager needs of a policy (see the module docstring)."""

    name: str
    # Whether after_op needs a full Snapshot (costs O(placements) per op to build).
    wants_snapshot_after_op: bool

    def evict(self, snapshot: Snapshot, needed_bytes: int) -> list[int]:
        """Keys of non-busy device-resident entries to demote, freeing >= ``needed_bytes``."""
        ...

    def after_op(self, op: OpView) -> list[Action]:
        """Demotions and prefetches to apply after ``op``."""
        ...
