"""The examples in the docstrings run and say what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

pytestmark = pytest.mark.engine_independent  # docstrings and docs (checked)

MODULES = [
    "tensorscope.checkpoint",
    "tensorscope.checkpoint.chain",
    "tensorscope.checkpoint.simulate",
    "tensorscope.checkpoint.solver",
    "tensorscope.checkpoint.tracker",
    "tensorscope.checkpoint.profile",
    "tensorscope.checkpoint.executor",
    "tensorscope.checkpoint.module",
    "tensorscope.checkpoint.explain",
    "tensorscope.checkpoint.find",
    "tensorscope.checkpoint.calls",
    "tensorscope.checkpoint.blockprobe",
    "tensorscope.checkpoint.blocks",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0
