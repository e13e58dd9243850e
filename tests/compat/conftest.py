"""Compatibility tests: the root conftest's isolation (tests/conftest.py), and after each test
the residency handles a test left registered are removed; compile tests also get a fresh dynamo
(``torch._dynamo.reset()``) after them, so that a graph cached by one test cannot make another
pass or fail."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from ._models import remove_live_handles


@pytest.fixture(autouse=True)
def _compat_isolation(request: pytest.FixtureRequest) -> Iterator[None]:
    try:
        yield
    finally:
        remove_live_handles()
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and request.node.module.__name__.endswith("test_compile"):
            dynamo.reset()
