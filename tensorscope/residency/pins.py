"""Pins: placements held on the device while an op (or a move) needs them there.

A pinned placement is never demoted, chosen to make room or forgotten by a sweep: an op in
flight on some thread reads or writes its bytes (manager.py's NOTE [threads]). Placements are
pinned only through ``ResidencyManager.pinned`` (``with manager.pinned(placements) as pins:``),
so every pin taken is given back on every path out, exceptions included; nothing else counts
``Placement.pins``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorscope.residency.placement import Placement

__all__ = ["Pins", "Unlocked"]


class Pins:
    """The pins of one holder. Entering pins each placement once; ``release()`` (or the end
    of the block) unpins them and wakes threads waiting for room (unless ``wake`` is False: the
    holder wakes them itself later); ``wait_for_room()`` lets go of them while this thread
    waits for another's op to end, and pins them again. Each takes the manager's lock
    (re-entrant: callers usually hold it already)."""

    __slots__ = ("_held", "_lock", "_placements", "_room", "_wait_s", "_wake")

    def __init__(
        self,
        placements: Sequence[Placement],
        lock: threading.RLock,
        room: threading.Condition,
        wait_s: float,
        wake: bool = True,
    ) -> None:
        self._placements = placements  # not changed by the holder while pinned
        self._lock = lock
        self._room = room
        self._wait_s = wait_s
        self._wake = wake
        self._held = False

    def __enter__(self) -> Pins:
        with self._lock:
            for placement in self._placements:
                placement.pins += 1
            self._held = True
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._held:  # release(), inlined: every op of the Python op path ends here
            with self._lock:
                for placement in self._placements:
                    placement.pins -= 1
                self._held = False
                if self._wake:
                    self._room.notify_all()

    def release(self) -> None:
        """Unpin now (before the block ends) and wake threads waiting for room."""
        with self._lock:
            if self._held:
                for placement in self._placements:
                    placement.pins -= 1
                self._held = False
                if self._wake:
                    self._room.notify_all()

    def wait_for_room(self) -> None:
        """Unpinned, wait until an op ends on another thread (or a short while), pin again:
        room that only other threads' ops can free must not wait on our pins."""
        with self._lock:
            placements = self._placements if self._held else ()
            for placement in placements:
                placement.pins -= 1
            try:
                self._room.wait(self._wait_s)
            finally:
                for placement in placements:
                    placement.pins += 1


class Unlocked:
    """Let go of one level of ``lock`` for the block (an op computes with its operands
    pinned: other threads may make room meanwhile), and take it back after."""

    __slots__ = ("_lock",)

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        self._lock.release()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._lock.acquire()
