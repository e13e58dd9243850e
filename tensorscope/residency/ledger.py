"""The ledger: what is managed, where each placement's bytes are counted, and peaks.

Plain bookkeeping without locks or moves: the manager holds its lock around every use.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from tensorscope._torch import storage_address
from tensorscope.residency import native
from tensorscope.residency.mapping import DiskRegion
from tensorscope.residency.placement import Placement
from tensorscope.residency.tiers import TIER_ORDER

__all__ = ["Ledger"]


_MASK = (1 << 64) - 1


def _mix(uid: int) -> int:
    """splitmix64's finalizer: uids spread over 64 bits, so that the XOR of a set of them
    tells sets apart (uids are small consecutive integers, whose XORs collide)."""
    z = (uid * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class Ledger:
    """Registry and accounting of placements."""

    def __init__(self) -> None:
        self.placements: dict[int, Placement] = {}  # storage key -> placement
        self.by_uid: dict[int, Placement] = {}
        self.by_role: dict[Hashable, Placement] = {}
        self.resident: dict[int, Placement] = {}  # uid -> placements on the device tier
        # A fingerprint of the resident set (equal sets, equal prints): the key of a decision
        # made before in the same state (cadence.py).
        self.resident_print = 0
        self.bytes: dict[str, int] = dict.fromkeys(TIER_ORDER, 0)
        self.peak: dict[str, int] = dict.fromkeys(TIER_ORDER, 0)
        # Device bytes promised to ops in flight for their results (counted against the budget).
        self.reserved = 0
        self.transfers: list[float] = [0, 0, 0.0]  # count, bytes, seconds
        self.prefetched = 0

    # ------------------------------------------------------------------------------ lookups
    def find(self, tensor: torch.Tensor) -> Placement | None:
        """The placement managing ``tensor``'s storage, or None."""
        if tensor.layout is not torch.strided or tensor.device.type == "meta":
            return None
        return self.placements.get(storage_address(tensor))

    @property
    def device_total(self) -> int:
        """Device bytes resident plus those reserved for results of ops in flight."""
        return self.bytes["device"] + self.reserved

    def __len__(self) -> int:
        return len(self.placements)

    # ------------------------------------------------------------------------- bookkeeping
    def add(self, placement: Placement) -> None:
        self.placements[placement.key] = placement
        self.by_uid[placement.uid] = placement
        self.by_role[placement.role] = placement
        self.account(placement.tier, placement.nbytes)
        self.track(placement)

    def rename(self, placement: Placement, role: Hashable) -> None:
        """Give ``placement`` a new role (a managed tensor's name, when a handle claims it)."""
        if self.by_role.get(placement.role) is placement:
            del self.by_role[placement.role]
        placement.role = role
        self.by_role[role] = placement

    def track(self, placement: Placement) -> None:
        """Keep the set of device-resident placements in step with ``placement.tier``."""
        uid = placement.uid
        if placement.tier == "device":
            if uid not in self.resident:
                self.resident[uid] = placement
                self.resident_print ^= _mix(uid)
        elif self.resident.pop(uid, None) is not None:
            self.resident_print ^= _mix(uid)
        native.publish(placement)

    def account(self, tier: str, delta: int) -> None:
        total = self.bytes[tier] + delta
        self.bytes[tier] = total
        if total > self.peak[tier]:
            self.peak[tier] = total

    def moved(self, placement: Placement, source: str, seconds: float) -> None:
        """Account a move of ``placement`` from ``source`` to its current tier."""
        self.track(placement)
        self.account(source, -placement.nbytes)
        self.account(placement.tier, placement.nbytes)
        self.count_transfer(placement.nbytes, seconds)

    def forget(self, placement: Placement, tier: str | None = None) -> DiskRegion | None:
        """Drop ``placement`` (counted on ``tier``, default its own); returns its disk region
        for the caller to release."""
        native.drop(placement)
        self.placements.pop(placement.key, None)
        self.by_uid.pop(placement.uid, None)
        if self.resident.pop(placement.uid, None) is not None:
            self.resident_print ^= _mix(placement.uid)
        if self.by_role.get(placement.role) is placement:
            del self.by_role[placement.role]
        self.account(tier or placement.tier, -placement.nbytes)
        region, placement.region = placement.region, None
        return region

    def count_transfer(self, nbytes: int, seconds: float) -> None:
        self.transfers[0] += 1
        self.transfers[1] += nbytes
        self.transfers[2] += seconds

    def reset_peaks(self) -> None:
        self.peak = dict(self.bytes)

    def reset_counters(self) -> None:
        self.reset_peaks()
        self.transfers = [0, 0, 0.0]
        self.prefetched = 0
