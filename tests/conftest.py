"""Shared test configuration: every test starts and ends with no scope open and clean stacks."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

import tensorscope as ts
from tensorscope._torch import scope_key_included


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _clean_interception_state() -> Iterator[None]:
    assert ts.current_scope() is None, "a previous test left a scope open"
    yield
    gc.collect()
    assert ts.current_scope() is None, "test left a scope open"
    assert torch._C._len_torch_dispatch_stack() == 0, "test left a dispatch mode pushed"
    assert not scope_key_included(), "test left the scope engines' key included"
