"""The background threads that map CPU placements' pages in ahead of their use.

Two threads: from a cold page cache two streams of reads ran ~1.5x as fast as one here (the
disk serves requests in parallel), and Flow went from 1.69x to 1.30x plain on
``offload_inference.py --cold`` (docs/design.md §8)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from tensorscope.residency.pace import Pace
from tensorscope.residency.placement import Placement

__all__ = ["Prefetcher"]


class Prefetcher:
    """Daemon threads mapping pages in (CPU) while the main thread computes."""

    def __init__(
        self,
        pace: Pace,
        landed: Callable[[Placement, threading.Event], None] | None = None,
        threads: int = 2,
    ) -> None:
        import queue

        self._pace = pace
        self._landed = landed  # told after each placement's pages are in
        self._queue: queue.SimpleQueue[list[tuple[Placement, threading.Event]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._run, name=f"tensorscope-prefetch-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, placement: Placement, event: threading.Event) -> None:
        self._queue.put([(placement, event)])

    def submit_many(self, items: list[tuple[Placement, threading.Event]]) -> None:
        """Prefetches in order of need, dealt to the threads in turn: each wakes once."""
        count = len(self._threads)
        for share in (items[i::count] for i in range(min(count, len(items)))):
            self._queue.put(share)

    def _run(self) -> None:
        while True:
            items = self._queue.get()
            if items is None:
                return
            for placement, event in items:
                self._populate(placement, event)

    def _populate(self, placement: Placement, event: threading.Event) -> None:
        try:
            region = placement.region
            if region is not None:
                started = time.perf_counter()
                region.populate(write=placement.written)
                self._pace.read(placement.nbytes, time.perf_counter() - started)
        except Exception:
            # A prefetch is only a head start: pages it did not map fault in when the op
            # reads them, and the op path checks the file first (a truncated one raises
            # ResidencyError there). The thread must live on for the next placements.
            pass
        finally:
            event.set()
        if self._landed is not None:
            # On failure the op that uses it waits on the event instead.
            with contextlib.suppress(Exception):
                self._landed(placement, event)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
