"""No fit test leaves a step hook of ours behind once its fits are gone (the rest of the
isolation, one torch thread included, is the root conftest's: tests/conftest.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tensorscope import _step_hooks


@pytest.fixture(autouse=True)
def _no_step_hook_left() -> Iterator[None]:
    gc.collect()
    before = _step_hooks.active()
    yield
    gc.collect()  # a fit dropped without remove() takes its hooks with it
    assert _step_hooks.active() <= before, "a test left a step hook of ours added"
