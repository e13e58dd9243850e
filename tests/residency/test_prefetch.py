"""The prefetch threads: two placements are mapped in at once (two streams of reads from a cold
page cache were ~1.5x as fast as one on this machine: docs/design.md §8)."""

from __future__ import annotations

import threading
from typing import Any

from tensorscope.residency.pace import Pace
from tensorscope.residency.prefetch import Prefetcher


class _Region:
    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier
        self.populated = False

    def populate(self, write: bool) -> None:
        self.barrier.wait(timeout=10)  # raises BrokenBarrierError unless both run at once
        self.populated = True


class _Placement:
    def __init__(self, region: _Region) -> None:
        self.region = region
        self.written = False


def _two_populated_at_once(prefetcher: Prefetcher) -> None:
    barrier = threading.Barrier(2)
    placements = [_Placement(_Region(barrier)) for _ in range(2)]
    events = [threading.Event() for _ in placements]
    for placement, event in zip(placements, events, strict=True):
        prefetcher.submit(placement, event)  # type: ignore[arg-type]
    assert all(event.wait(timeout=20) for event in events)
    assert all(p.region.populated for p in placements)


def test_two_placements_are_populated_concurrently() -> None:
    prefetcher = Prefetcher(Pace())
    try:
        _two_populated_at_once(prefetcher)
    finally:
        prefetcher.close()


def test_a_failed_populate_releases_its_waiter_and_the_threads_live_on() -> None:
    class Failing:
        def populate(self, write: bool) -> None:
            raise OSError("unreadable")

    prefetcher = Prefetcher(Pace())
    try:
        for _ in range(3):  # more failures than threads: a dead thread would hang the third
            placement: Any = _Placement(Failing())  # type: ignore[arg-type]
            event = threading.Event()
            prefetcher.submit(placement, event)
            assert event.wait(timeout=20)
        _two_populated_at_once(prefetcher)
    finally:
        prefetcher.close()
