"""Each trust test starts and ends with a reset residency manager and no scope open.

The regression tests of issue 8 (``DEFECTS_FROM_ISSUE_8.md``) run code that fails badly today: a
scope whose exit raises stays open, a manager may keep managed tensors. Leftovers are cleaned up
here so that one failure cannot cascade into the next test. A per-test watchdog dumps every
thread's stack and ends the run if a test hangs (a thread test that deadlocks after a fix).
"""

from __future__ import annotations

import faulthandler
import sys
import warnings
from collections.abc import Iterator

import pytest

import tensorscope as ts

HANG_SECONDS = 180


def _reset_residency() -> None:
    ts.residency.reset()
    ts.residency.configure(device="cpu", policy="flow", budget=None, offload_dir=None)
    ts.residency.report(reset=True)


def _close_leftover_scopes(limit: int = 64) -> int:
    """Close scopes a failed test left current in this thread (bounded: never hangs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for closed in range(limit):
            leftover = ts.current_scope()
            if leftover is None or leftover.is_closed:
                return closed
            try:
                leftover.close()
            except Exception:  # a close that fails today (a sparse ref, #11): the test failed
                if ts.current_scope() is leftover:
                    return closed
    return limit


@pytest.fixture(autouse=True)
def _trust_isolation() -> Iterator[None]:
    _close_leftover_scopes()
    _reset_residency()
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        _close_leftover_scopes()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # reset() may warn about what a failed test left
            _reset_residency()
