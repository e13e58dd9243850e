"""Shared fixtures for the dispose-scope tests (the isolation every test gets, no scope left
open included, is the root conftest's: tests/conftest.py).

``stats`` gives a test exact ``ts.stats()`` checks: it collects garbage left by earlier tests (so
that a ref freed late by the cycle collector cannot land in this test's counters), resets this
thread's counters and returns a checker that compares *every* counter at once.
"""

from __future__ import annotations

import gc

import pytest

import tensorscope as ts

from ._support import StatsChecker


@pytest.fixture
def stats() -> StatsChecker:
    """Zeroed counters for this test, and a checker for them."""
    gc.collect()
    ts.reset_stats()
    return StatsChecker()
