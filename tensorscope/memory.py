"""Measuring memory honestly: process RSS sampled in the background, peaks above a baseline.

``psutil`` is imported when first needed (it is an optional dependency: ``pip install
tensorscope[demo]``), so ``import tensorscope`` needs only torch.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

from typing_extensions import Self

from tensorscope.errors import ArgumentTypeError

__all__ = ["PeakRSS", "rss_bytes"]


def _process() -> Any:
    try:
        import psutil
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ArgumentTypeError(
            "tensorscope.memory: measuring process memory needs psutil; "
            "install it with `pip install tensorscope[demo]` (or `pip install psutil`)."
        ) from exc
    return psutil.Process()


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    return int(_process().memory_info().rss)


class PeakRSS:
    """Sample this process's RSS on a background thread; report the peak above a baseline.

    The baseline is the RSS at ``__enter__`` (or ``baseline_bytes`` if given). Sampling every
    ``interval_s`` catches transient peaks that a before/after measurement would miss.

    Example:
        >>> import torch
        >>> with PeakRSS(interval_s=0.001) as peak:
        ...     x = torch.ones(64 * 1024 * 1024 // 4); del x
        >>> peak.peak_above_baseline_bytes >= 0
        True
    """

    def __init__(self, interval_s: float = 0.002, baseline_bytes: int | None = None) -> None:
        self.interval_s = interval_s
        self.baseline_bytes = baseline_bytes
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process: Any = None

    def __enter__(self) -> Self:
        self._process = _process()
        now = int(self._process.memory_info().rss)
        if self.baseline_bytes is None:
            self.baseline_bytes = now
        self.peak_bytes = now
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tensorscope-rss", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval_s)

    def sample(self) -> int:
        """Take one sample now (also called by the background thread); returns the RSS."""
        now = int(self._process.memory_info().rss)
        if now > self.peak_bytes:
            self.peak_bytes = now
        return now

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    @property
    def peak_above_baseline_bytes(self) -> int:
        return self.peak_bytes - (self.baseline_bytes or 0)
