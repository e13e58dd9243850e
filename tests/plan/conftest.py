"""Each plan test starts and ends with no recording open, a reset residency manager, and one
intra-op thread (tiny tensors on a shared 2-core machine: see tests/compat/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import tensorscope as ts
from tensorscope.plan import hooks, mode


@pytest.fixture(autouse=True)
def _clean_recorder() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ts.residency.reset()
    ts.residency.configure(device="cpu", policy="flow", budget=None, offload_dir=None)
    yield
    torch.set_num_threads(threads)
    left = dict(mode.OPEN)
    mode.OPEN.clear()
    ts.residency.reset()
    ts.residency.configure(device="cpu", policy="flow", budget=None, offload_dir=None)
    assert not left, "a test left a ts.record() open"
    assert not hooks._handles, "a test left the recorder's global hooks installed"
