"""Helpers shared by the scope tests (kept out of conftest.py so tests can import them)."""

from __future__ import annotations

import warnings

import tensorscope as ts

COUNTERS = (
    "created_in_scope",
    "created_outside_scope",
    "disposed_in_scope",
    "disposed_outside_scope",
    "attached",
    "detached",
)
FIELDS = (*COUNTERS, "live")


def snapshot() -> dict[str, int]:
    """This thread's counters as a plain dict."""
    current = ts.stats()
    return {name: getattr(current, name) for name in FIELDS}


class StatsChecker:
    """``stats(created_in_scope=2, disposed_in_scope=1)`` asserts all counters, unnamed ones 0.

    ``live`` defaults to created - disposed (both kinds), so each check also checks that identity.
    """

    def snapshot(self) -> dict[str, int]:
        return snapshot()

    def expected(self, **counts: int) -> dict[str, int]:
        unknown = set(counts) - set(FIELDS)
        if unknown:
            raise TypeError(f"unknown counters {sorted(unknown)}")
        full = dict.fromkeys(FIELDS, 0)
        full.update(counts)
        if "live" not in counts:
            full["live"] = (
                full["created_in_scope"]
                + full["created_outside_scope"]
                - full["disposed_in_scope"]
                - full["disposed_outside_scope"]
            )
        return full

    def __call__(self, **counts: int) -> None:
        actual = self.snapshot()
        expected = self.expected(**counts)
        if actual != expected:
            wrong = {
                k: f"{actual[k]} (expected {expected[k]})"
                for k in FIELDS
                if actual[k] != expected[k]
            }
            raise AssertionError(f"ts.stats() mismatch: {wrong}; all counters: {actual}")


def close_leftover_scopes(limit: int = 64) -> int:
    """Close whatever scopes are still current, innermost first; return how many there were.

    Leak warnings are silenced here. Bounded, so that an implementation that keeps a closed scope
    current fails instead of hanging.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for closed in range(limit):
            leftover = ts.current_scope()
            if leftover is None:
                return closed
            if leftover.is_closed:
                raise AssertionError(f"ts.current_scope() returned the closed scope {leftover!r}")
            leftover.close()
    raise AssertionError(f"still a scope open after closing {limit} scopes")
