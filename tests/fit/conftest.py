"""Offload tests run with one intra-op thread (tiny tensors on a shared 2-core machine: see
tests/compat/conftest.py); plain and offloaded runs use the same setting, so bit-for-bit
comparisons hold."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
