"""Each plan test ends with no recording open and the recorder's global hooks removed (the rest
of the isolation, a reset residency manager and one torch thread, is the root conftest's:
tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tensorscope.plan import hooks, mode


@pytest.fixture(autouse=True)
def _clean_recorder() -> Iterator[None]:
    yield
    left = dict(mode.OPEN)
    mode.OPEN.clear()
    assert not left, "a test left a ts.record() open"
    assert not hooks._handles, "a test left the recorder's global hooks installed"
