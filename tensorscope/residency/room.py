"""Making room under the budget: what the policy sees, and which placements to demote.

Functions of the ledger, the policy and the recorder, given as arguments; the manager applies
the demotions they choose. A placement pinned by an op in flight (on any thread) is never
chosen: its bytes are being read or written right now.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from tensorscope.graph.order import ModuleOrder
from tensorscope.graph.record import Recorder
from tensorscope.policies import Entry, Policy, Snapshot
from tensorscope.residency.ledger import Ledger
from tensorscope.residency.placement import Placement

__all__ = ["Blocked", "snapshot", "victims"]


class Blocked(Exception):
    """Room can come only from ops in flight on other threads (see ``make_room``)."""


def snapshot(
    ledger: Ledger,
    recorder: Recorder,
    budget: int | None,
    clock: int,
    upcoming: bool = False,
    read_rate: float | None = None,
    order: ModuleOrder | None = None,
    horizon: int | None = None,
) -> Snapshot:
    """What a policy decides from: the device-resident placements (built lazily), and the
    placements used next that are not resident (``upcoming``). Next uses come from the
    previous iteration; while it predicts nothing, from ``order`` (see graph/order.py).
    ``horizon``: see ``Snapshot.horizon`` (cadence.py)."""
    resident = list(ledger.resident.values())
    guess = None if recorder.predicting or order is None or not len(order) else order
    position = recorder.position

    def next_use(role: Hashable) -> int | None:
        if guess is None:
            return recorder.next_use(role)
        distance = guess.distance(role)
        return None if distance is None else position + distance

    def entries() -> tuple[Entry, ...]:
        return tuple(
            Entry(p.uid, p.nbytes, p.tier, p.last_use, next_use(p.role), p.pins > 0)
            for p in resident
        )

    ahead: tuple[Entry, ...] = ()
    if upcoming and (guess is not None or recorder.predicting):
        roles = recorder.upcoming(32, horizon or -1) if guess is None else guess.upcoming(32)
        wanted = []
        for role in roles:
            p = ledger.by_role.get(role)
            if p is not None and p.tier != "device":
                index = next_use(role)
                eta = None if index is None or guess is not None else recorder.seconds_until(index)
                wanted.append(Entry(p.uid, p.nbytes, p.tier, p.last_use, index, False, eta))
        ahead = tuple(wanted)
    return Snapshot(
        budget,
        ledger.device_total,
        clock,
        None,
        ahead,
        make_entries=entries,
        read_rate=read_rate,
        horizon=horizon,
    )


def victims(
    ledger: Ledger,
    policy: Policy,
    recorder: Recorder,
    budget: int,
    clock: int,
    shortfall: int,
    order: ModuleOrder | None = None,
) -> Iterator[Placement]:
    """Device placements to demote, in order, until ``shortfall`` bytes are freed: the
    policy's choice first, then (the budget is a hard limit) the least recently used of the
    rest. The caller stops iterating once it has room."""
    chosen: set[int] = set()
    for key in policy.evict(snapshot(ledger, recorder, budget, clock, order=order), shortfall):
        placement = ledger.by_uid.get(key)
        if placement is None or placement.tier != "device" or placement.pins or key in chosen:
            continue
        chosen.add(key)
        yield placement
    idle = sorted(
        (p for p in ledger.resident.values() if not p.pins and p.uid not in chosen),
        key=lambda p: p.last_use,
    )
    yield from idle
