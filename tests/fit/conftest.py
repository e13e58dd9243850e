"""Fit and offload tests run with one intra-op thread (tiny tensors on a shared 2-core machine:
see tests/compat/conftest.py); plain and fitted runs use the same setting, so bit-for-bit
comparisons hold. No test leaves a step hook of ours behind once its fits are gone."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from tensorscope import _step_hooks


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    before = _step_hooks.active()
    yield
    torch.set_num_threads(threads)
    gc.collect()  # a fit dropped without remove() takes its hooks with it
    assert _step_hooks.active() <= before, "a test left a step hook of ours added"
