"""Which residency tier a managed storage is on (for ``MemoryPlan.at_peak_by_tier``).

# NOTE [a read of the manager's ledger]
# The residency manager answers ``tier_of(tensor)``; the recorder holds no tensors (it must not
# keep memory alive), only each storage's ``StorageImpl`` address, which is also the manager's
# key for a placement (residency/placement.py). So this reads the ledger's placement table by
# that key, read-only. A public ``tier_of_storage(address)`` on the manager would replace it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["tier_reader"]


def tier_reader(manager: Any) -> Callable[[int], str | None]:
    """A function: a storage's address -> the tier its placement is on, or None (unmanaged)."""
    placements: dict[int, Any] = manager.ledger.placements

    def tier_of(address: int) -> str | None:
        placement = placements.get(address)
        return None if placement is None else str(placement.tier)

    return tier_of
