"""The background thread that maps a CPU placement's pages in ahead of its use."""

from __future__ import annotations

import threading

from tensorscope.residency.placement import Placement

__all__ = ["Prefetcher"]


class Prefetcher:
    """One daemon thread mapping pages in (CPU) while the main thread computes."""

    def __init__(self) -> None:
        import queue

        self._queue: queue.SimpleQueue[tuple[Placement, threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="tensorscope-prefetch", daemon=True)
        self._thread.start()

    def submit(self, placement: Placement, event: threading.Event) -> None:
        self._queue.put((placement, event))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            placement, event = item
            try:
                region = placement.region
                if region is not None:
                    region.populate(write=placement.written)
            finally:
                event.set()

    def close(self) -> None:
        self._queue.put(None)
