"""Pinned host memory for copies, bounded: the pool, its limit and its pageable fallback.

# NOTE [the pinned pool]
# Pinned (page-locked) host memory is what lets a copy between the device and the host run
# asynchronously, but the kernel cannot page it out: pinning too much starves the machine. The
# pool hands out pinned blocks while at most ``limit`` bytes are live (TENSORSCOPE_PINNED_LIMIT,
# default half the machine's memory). On CUDA the blocks come from torch's caching host
# allocator, which keeps freed blocks for reuse and records the events of the copies that use
# them. Past the limit, or when pinning fails (the driver refuses, a locked-memory limit),
# ``take`` returns None and the caller copies through pageable memory: slower (a blocking
# copy), never a crash. The fallbacks are counted with their reason, and
# ``ts.residency.report()`` shows them. A failed pin is not tried again until some pinned
# memory was given back.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

import torch

from tensorscope._units import format_bytes, parse_bytes
from tensorscope.residency.backends.base import first_line

__all__ = ["PinnedPool", "default_limit"]

LIMIT_VARIABLE = "TENSORSCOPE_PINNED_LIMIT"


def default_limit() -> int:
    """``TENSORSCOPE_PINNED_LIMIT`` (bytes or "8GiB"), else half the machine's memory."""
    wanted = os.environ.get(LIMIT_VARIABLE, "").strip()
    if wanted:
        value: object = int(wanted) if wanted.isdigit() else wanted
        return parse_bytes(value, what=LIMIT_VARIABLE, subsystem="tensorscope.residency")
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):  # pragma: no cover - no sysconf: a fixed 4 GiB
        return 4 << 30


class PinnedPool:
    """Pinned blocks while ``limit`` allows (see the NOTE); ``pin(nbytes)`` makes one."""

    def __init__(self, pin: Callable[[int], torch.UntypedStorage], limit: int) -> None:
        self._pin = pin
        self.limit = limit
        self.live_bytes = 0
        self.peak_bytes = 0
        self.fallbacks = 0  # copies that went through pageable memory instead
        self.why: str | None = None  # the latest fallback's reason
        self._failed_at: int | None = None  # live bytes when pinning last failed
        self._blocks: dict[int, int] = {}  # address -> bytes, of the live blocks
        self._lock = threading.RLock()  # a finalizer may run while it is held

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """A pinned block of ``nbytes``, or None (counted: the caller uses pageable memory)."""
        with self._lock:
            if self.live_bytes + nbytes > self.limit:
                self._fallback(
                    f"the pinned pool's limit of {format_bytes(self.limit)} was reached "
                    f"({LIMIT_VARIABLE})"
                )
                return None
            if self._failed_at is not None and self.live_bytes >= self._failed_at:
                self._fallback(self.why or "pinning failed")
                return None
            self.live_bytes += nbytes
        try:
            block = self._pin(nbytes)
        except (RuntimeError, MemoryError) as exc:
            with self._lock:
                self.live_bytes -= nbytes
                self._failed_at = self.live_bytes
                self._fallback(f"pinning host memory failed ({first_line(exc)})")
                return None
        address = block.data_ptr()
        with self._lock:
            self._blocks[address] = nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(block, self._give_back, address, nbytes)
        return block

    def holds(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage``'s memory is a live block of this pool."""
        nbytes = self._blocks.get(storage.data_ptr())
        return nbytes is not None and storage.nbytes() <= nbytes

    def _fallback(self, why: str) -> None:
        self.fallbacks += 1
        self.why = why
        return None

    def _give_back(self, address: int, nbytes: int) -> None:
        with self._lock:
            if self._blocks.pop(address, None) is not None:
                self.live_bytes -= nbytes
                if self._failed_at is not None and self.live_bytes < self._failed_at:
                    self._failed_at = None
