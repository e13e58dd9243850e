"""Checks that pass, fail, raise, hang and crash: what the runner must report (test_runner.py)."""

from __future__ import annotations

import os
import time

from tensorscope.check.context import Context


def passes(ctx: Context) -> None:
    ctx.note("device", str(ctx.device))
    ctx.expect("one and one", 1 + 1 == 2, 2, 2)


def fails(ctx: Context) -> None:
    ctx.expect("a finding that does not hold", False, "3 B", "0 B")
    ctx.expect("one that does, after it", True, 0, 0)


def raises(ctx: Context) -> None:
    ctx.expect("before the error", True, 0, 0)
    raise ValueError("a check's own bug")


def hangs(ctx: Context) -> None:
    ctx.expect("found before hanging", True, 1, 1)
    time.sleep(600)


def crashes(ctx: Context) -> None:
    ctx.note("about to crash", True)
    os._exit(3)  # as a segfault would: no result written


def finds_nothing(ctx: Context) -> None:
    ctx.note("only evidence", 1)
