"""Moving placements between tiers, and making room under the budget as the policy decides."""

from __future__ import annotations

import threading

from tensorscope._ledger import Ledger
from tensorscope._placement import Movers, Placement
from tensorscope._prefetch import Prefetcher
from tensorscope._torch import cuda_stream
from tensorscope._units import format_bytes
from tensorscope.errors import InvalidArgumentError, OutOfBudgetError, ResidencyError
from tensorscope.policies import Action, Entry, Snapshot
from tensorscope.tiers import (
    TIER_ORDER,
    DeviceTier,
    DiskTier,
    HostTier,
    TierName,
    release_free_heap,
)

__all__ = ["Moving"]


class Moving(Ledger):
    """Demotions, promotions, prefetches and room-making (the policy decides, this applies)."""

    @property
    def tiers(self) -> tuple[TierName, ...]:
        """The tiers in use, top to bottom (no host tier when the device is the CPU)."""
        if self._device.type == "cpu":
            return ("device", "disk")
        return TIER_ORDER

    def _movers(self) -> Movers:
        if self._disk is None:
            self._disk = DiskTier(self._offload_dir)
        if self._device.type == "cuda":
            if self._host is None:
                self._host = HostTier()
            if self._copy_stream is None:
                self._copy_stream = cuda_stream(self._device)
        if self._mover is None or self._mover.disk is not self._disk:
            self._mover = Movers(
                DeviceTier(self._device), self._host, self._disk, self._copy_stream
            )
        return self._mover

    def flush_disk(self) -> None:
        """Write dirty offload pages to disk now, so background writeback does not compete
        with the next iterations (called once by ``ts.manage()``)."""
        with self._lock:
            for placement in self._placements.values():
                if placement.region is not None:
                    placement.region.flush()

    def back_with_files(self, uids: set[int]) -> None:
        """CPU device: move the heap memory of these device-resident placements into mapped
        disk regions (``Movers.back_with_file``); a full disk leaves them where they are."""
        if self._device.type != "cpu":
            return
        movers = self._movers()
        for placement in list(self._resident.values()):
            if placement.uid in uids:
                try:
                    movers.back_with_file(placement)
                except ResidencyError:
                    return  # no room on disk: they stay in heap memory, which works too

    def release_heap(self, threshold: int = 64 << 20) -> None:
        """Return heap memory freed by first demotions to the OS once enough has piled up."""
        mover = self._mover
        if mover is not None and mover.migrated_bytes >= threshold:
            mover.migrated_bytes = 0
            release_free_heap()

    def _on_iteration_end(self) -> None:
        self._sweep()
        self.release_heap()

    def _lower(self, tier: str) -> TierName:
        tiers = self.tiers
        index = tiers.index(tier)  # type: ignore[arg-type,unused-ignore]
        return tiers[min(index + 1, len(tiers) - 1)]

    def _check_tier(self, tier: object) -> TierName:
        if tier not in TIER_ORDER:
            raise InvalidArgumentError(
                f"tensorscope.residency: unknown tier {tier!r}; use 'device', 'host' or 'disk'."
            )
        if tier not in self.tiers:
            raise ResidencyError(
                f"tensorscope.residency: there is no {tier} tier when the device is "
                f"{self._device}; tiers here: {', '.join(self.tiers)}."
            )
        return tier  # type: ignore[return-value,unused-ignore]

    def _demote(self, placement: Placement, target: TierName | None = None) -> None:
        source = placement.tier
        target = target or self._lower(source)
        if TIER_ORDER.index(target) <= TIER_ORDER.index(source):
            return
        seconds = self._movers().demote(placement, target)  # raises before changing anything
        self._track(placement)
        self._account(source, -placement.nbytes)
        self._account(target, placement.nbytes)
        self._count_transfer(placement.nbytes, seconds)
        self.release_heap()

    def _promote(self, placement: Placement) -> None:
        if placement.tier == "device":
            return
        movers = self._movers()
        movers.check_readable(placement)
        source = placement.tier
        seconds = movers.promote(placement)
        self._track(placement)
        self._account(source, -placement.nbytes)
        self._account("device", placement.nbytes)
        self._count_transfer(placement.nbytes, seconds)

    def _prefetch(self, placement: Placement) -> None:
        """Account a placement as resident now; its bytes arrive in the background (pages
        mapped by the prefetch thread on a CPU device, a copy stream on CUDA)."""
        movers = self._movers()
        if self._device.type == "cuda":
            movers.check_readable(placement)
            source = placement.tier
            seconds = movers.promote(placement, background=True)
            self._track(placement)
            self._account(source, -placement.nbytes)
            self._account("device", placement.nbytes)
            self._count_transfer(placement.nbytes, seconds)
            self._prefetched += 1
            return
        if placement.tier != "disk":
            self._promote(placement)
            return
        movers.check_readable(placement)
        if self._prefetcher is None:
            self._prefetcher = Prefetcher()
        event = threading.Event()
        placement.pending = event
        placement.tier = "device"
        self._track(placement)
        self._account("disk", -placement.nbytes)
        self._account("device", placement.nbytes)
        self._count_transfer(placement.nbytes, 0.0)
        self._prefetched += 1
        self._prefetcher.submit(placement, event)

    def _check_fits(self, nbytes: int, what: str) -> None:
        if self._budget is not None and nbytes > self._budget:
            raise OutOfBudgetError(
                f"tensorscope.residency: {what} needs {format_bytes(nbytes)} on the device at "
                f"once, more than the whole budget of {format_bytes(self._budget)}. Nothing was "
                "moved. Raise the budget (ts.residency.configure(budget=...)) or split the op."
            )

    def _snapshot(self, upcoming: bool = False) -> Snapshot:
        recorder = self.recorder
        busy = set(self._busy)
        resident = list(self._resident.values())

        def entries() -> tuple[Entry, ...]:
            return tuple(
                Entry(p.uid, p.nbytes, p.tier, p.last_use, recorder.next_use(p.role), p.uid in busy)
                for p in resident
            )

        ahead: tuple[Entry, ...] = ()
        if upcoming and recorder.predicting:
            wanted = []
            for role in recorder.upcoming(32):
                p = self._by_role.get(role)
                if p is not None and p.tier != "device":
                    wanted.append(
                        Entry(p.uid, p.nbytes, p.tier, p.last_use, recorder.next_use(role), False)
                    )
            ahead = tuple(wanted)
        return Snapshot(
            self._budget, self._bytes["device"], self.clock, None, ahead, make_entries=entries
        )

    def _make_room(self, needed: int, what: str) -> None:
        budget = self._budget
        if budget is None or self._bytes["device"] + needed <= budget:
            return
        if self._since_sweep > 8:
            self._sweep()  # placements nothing holds any more free room for nothing
        shortfall = self._bytes["device"] + needed - budget
        if shortfall <= 0:
            return
        for key in self._policy.evict(self._snapshot(), shortfall):
            placement = self._by_uid.get(key)
            if placement is None or placement.tier != "device" or placement.uid in self._busy:
                continue
            self._demote(placement)
            if self._bytes["device"] + needed <= budget:
                return
        # The policy freed too little: the budget is a hard limit, so demote LRU-first.
        idle = sorted(
            (p for p in self._resident.values() if p.uid not in self._busy),
            key=lambda p: p.last_use,
        )
        for placement in idle:
            if self._bytes["device"] + needed <= budget:
                return
            self._demote(placement)
        if self._bytes["device"] + needed > budget:
            raise OutOfBudgetError(
                f"tensorscope.residency: {what} needs {format_bytes(needed)} more on the device "
                f"but only {format_bytes(budget - self._bytes['device'])} of the "
                f"{format_bytes(budget)} budget can be freed. Raise the budget."
            )

    def _apply(self, actions: list[Action]) -> None:
        budget = self._budget
        for action in actions:
            placement = self._by_uid.get(action.key)
            if placement is None:
                continue
            if action.kind == "demote":
                if placement.tier == "device":
                    self._demote(placement)
            elif action.kind == "prefetch" and placement.tier != "device":
                if budget is not None and self._bytes["device"] + placement.nbytes > budget:
                    continue  # the policy's plan no longer fits: skip, the op will promote
                self._prefetch(placement)
