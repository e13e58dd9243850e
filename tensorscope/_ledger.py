"""The ledger of managed placements: registry, per-tier accounting, and forgetting the dead.

The residency manager is built in three layers, each a base class of the next: this ledger
(what is managed and where its bytes are counted), the moves and room-making (``_moving.py``),
and the op path (``_oppath.py``); ``residency.py`` puts the public face on them.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

import torch

from tensorscope._placement import Movers, Placement
from tensorscope.tiers import DiskTier, HostTier

if TYPE_CHECKING:
    from tensorscope._prefetch import Prefetcher
    from tensorscope._state import ThreadData
    from tensorscope.graph.record import Recorder
    from tensorscope.policies import Policy

__all__ = ["Ledger"]


class Ledger:
    """Registry and accounting of placements (state is set up by ``ResidencyManager``)."""

    _lock: threading.RLock
    _device: torch.device
    _policy: Policy
    _budget: int | None
    _offload_dir: str | None
    _disk: DiskTier | None
    _host: HostTier | None
    _placements: dict[int, Placement]  # storage key -> placement
    _by_uid: dict[int, Placement]
    _by_role: dict[Hashable, Placement]
    _resident: dict[int, Placement]  # uid -> placements on the device tier
    _bytes: dict[str, int]
    _peak: dict[str, int]
    _transfers: list[float]
    _prefetched: int
    clock: int
    _since_sweep: int
    recorder: Recorder
    _meta_cache: dict[Hashable, int]
    _prefetcher: Prefetcher | None
    _copy_stream: torch.cuda.Stream | None
    _mover: Movers | None
    _busy: set[int]
    _threads: dict[int, ThreadData]

    if TYPE_CHECKING:

        def _movers(self) -> Movers: ...

        def _stop_intercepting(self) -> None: ...

    def _add(self, placement: Placement) -> None:
        self._placements[placement.key] = placement
        self._by_uid[placement.uid] = placement
        self._by_role[placement.role] = placement
        self._account(placement.tier, placement.nbytes)
        self._track(placement)

    def _track(self, placement: Placement) -> None:
        """Keep the set of device-resident placements in step with ``placement.tier``."""
        if placement.tier == "device":
            self._resident[placement.uid] = placement
        else:
            self._resident.pop(placement.uid, None)

    def _account(self, tier: str, delta: int) -> None:
        total = self._bytes[tier] + delta
        self._bytes[tier] = total
        if total > self._peak[tier]:
            self._peak[tier] = total

    def _forget(self, placement: Placement) -> None:
        placement.wait()
        self._placements.pop(placement.key, None)
        self._by_uid.pop(placement.uid, None)
        self._resident.pop(placement.uid, None)
        if self._by_role.get(placement.role) is placement:
            del self._by_role[placement.role]
        self._account(placement.tier, -placement.nbytes)
        region = placement.region
        if region is not None:
            placement.region = None
            if self._disk is not None:
                # Nothing uses its memory any more (the storage died, or has device memory).
                self._disk.release(region, reusable=True)
            else:
                region.close()

    def unregister(self, placement: Placement) -> None:
        """Stop managing: the bytes go back to ordinary device memory."""
        with self._lock:
            if self._placements.get(placement.key) is not placement:
                return
            placement.wait()
            source = placement.tier
            self._movers().materialize(placement)
            self._account(source, -placement.nbytes)
            self._account("device", placement.nbytes)
            self._forget(placement)

    def _sweep(self, keys: Iterable[int] | None = None) -> None:
        """Forget placements whose storage nothing but the placement still holds."""
        self._since_sweep = 0
        candidates = (
            list(self._placements.values())
            if keys is None
            else [p for k in keys if (p := self._placements.get(k)) is not None]
        )
        for placement in candidates:
            if not placement.alive_elsewhere():
                self._forget(placement)
        if not self._placements and self._threads:
            self._stop_intercepting()

    def managed_count(self) -> int:
        return len(self._placements)

    def holds(self, key: int) -> int:
        """References this manager holds to the storage ``key`` (for disposal accounting)."""
        return 1 if key in self._placements else 0

    def on_disposed(self, keys: list[int]) -> None:
        """Refs of these storages were disposed: forget placements nothing else holds."""
        if any(key in self._placements for key in keys):
            with self._lock:
                self._sweep(keys)

    def _count_transfer(self, nbytes: int, seconds: float) -> None:
        self._transfers[0] += 1
        self._transfers[1] += nbytes
        self._transfers[2] += seconds
