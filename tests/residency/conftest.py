"""Each residency test starts from a reset manager on the CPU with no budget."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tensorscope as ts


@pytest.fixture(autouse=True)
def _fresh_manager() -> Iterator[None]:
    ts.residency.reset()
    ts.residency.configure(device="cpu", policy="flow", budget=None, offload_dir=None)
    ts.residency.report(reset=True)
    yield
    ts.residency.reset()
    ts.residency.configure(device="cpu", policy="flow", budget=None, offload_dir=None)
