"""How fast the disk delivers and how fast the ops compute: what sets Flow's prefetch depth.

Two measurements, kept for the process's manager:
- the disk's read rate, an exponential average of the bytes per second of reads from the disk
  tier (synchronous promotions and the prefetch threads' populates; two threads populating at
  once each see part of the disk, so the rate errs low, towards prefetching more). A read
  faster than ``PAGE_CACHE_RATE`` found its pages in the kernel's page cache and says nothing
  of the disk: it is not counted.
- a compute clock: wall time minus the time ops spent waiting for their operands' bytes. The
  recorder stamps each op with it, so the previous iteration tells how many seconds of compute
  separate two ops, whatever the stalls of that iteration were.
"""

from __future__ import annotations

import threading
import time

__all__ = ["PAGE_CACHE_RATE", "Pace"]

PAGE_CACHE_RATE = 8e9  # bytes/s; this machine's disk: 1.4-3.7 GB/s, page-cache maps: 20+ GB/s
_SMOOTHING = 0.25  # weight of a new read in the average
_MIN_READ_BYTES = 1 << 20  # smaller reads time the call more than the disk


class Pace:
    """The measured read rate and the compute clock (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stalled = 0.0
        self.read_rate: float | None = None  # bytes/s; None until a disk read was timed

    def clock(self) -> float:
        """Seconds of compute so far: wall time minus the time spent waiting for reads."""
        return time.perf_counter() - self._stalled

    def clock_at(self, counter: float) -> float:
        """The compute clock at ``counter`` (a ``time.perf_counter()`` value of an op the C++
        op path ran: no stall since, it runs only while nothing moves)."""
        return counter - self._stalled

    def stalled(self, seconds: float) -> None:
        """An op waited ``seconds`` for its operands' bytes."""
        if seconds > 0:
            with self._lock:
                self._stalled += seconds

    def read(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` were read from the disk tier in ``seconds``."""
        if nbytes < _MIN_READ_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        if rate >= PAGE_CACHE_RATE:
            return
        with self._lock:
            old = self.read_rate
            self.read_rate = rate if old is None else old + _SMOOTHING * (rate - old)
