"""Each compatibility test starts and ends with a reset residency manager and no scope open.

Compile tests also get a fresh dynamo (``torch._dynamo.reset()``) after them, so that a graph
cached by one test cannot make another pass or fail. A per-test watchdog dumps every thread's
stack and ends the run if one test hangs (a deadlocked DataLoader worker or a stuck prefetch
thread would otherwise hang the whole suite silently).

Torch runs with one intra-op thread here: the tensors are tiny, and on a 2-core machine shared
with other work two OpenMP threads spin-wait on each other (a 14-layer MLP's backward took 0.5 s
instead of 0.5 ms under load). Plain and tensorscope runs use the same setting, so bit-for-bit
comparisons are unaffected; the setting is restored after each test.
"""

from __future__ import annotations

import faulthandler
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch

import tensorscope as ts

from ._models import remove_live_handles

HANG_SECONDS = 240


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
            leftover.close()
    return limit


@pytest.fixture(autouse=True)
def _compat_isolation(request: pytest.FixtureRequest) -> Iterator[None]:
    _close_leftover_scopes()
    _reset_residency()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        torch.set_num_threads(threads)
        left_open = _close_leftover_scopes()
        remove_live_handles()
        _reset_residency()
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and request.node.module.__name__.endswith("test_compile"):
            dynamo.reset()
        assert left_open == 0, f"the test left {left_open} scope(s) open"
