"""Shared fixtures for the dispose-scope tests.

Every test starts with no scope open in the main thread and fails if it leaves one open.
``stats`` gives a test exact ``ts.stats()`` checks: it collects garbage left by earlier tests (so
that a ref freed late by the cycle collector cannot land in this test's counters), resets this
thread's counters and returns a checker that compares *every* counter at once.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import tensorscope as ts

from ._support import StatsChecker, close_leftover_scopes


@pytest.fixture
def stats() -> StatsChecker:
    """Zeroed counters for this test, and a checker for them."""
    gc.collect()
    ts.reset_stats()
    return StatsChecker()


@pytest.fixture(autouse=True)
def _no_scope_left_open() -> Iterator[None]:
    """Start with no scope open; fail (in teardown) a test that leaves one open."""
    close_leftover_scopes()  # after a hard failure elsewhere: start clean, do not cascade
    yield
    left_open = close_leftover_scopes()
    assert left_open == 0, f"the test left {left_open} scope(s) open"
