"""The pure rules of activation offload (no tensors)."""

from __future__ import annotations

import math

import pytest

from tensorscope.fit.offload_rules import (
    DEFAULT_MIN_BYTES,
    Bandwidth,
    Decision,
    GroupStats,
    OffloadStats,
    SavedTensorFacts,
    decide,
    transfer_seconds,
)

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


def test_decide_order_of_reasons() -> None:
    big = DEFAULT_MIN_BYTES * 4
    assert decide(SavedTensorFacts(big)) is Decision.OFFLOAD
    assert decide(SavedTensorFacts(DEFAULT_MIN_BYTES - 1)) is Decision.SMALL
    assert decide(SavedTensorFacts(DEFAULT_MIN_BYTES)) is Decision.OFFLOAD
    assert decide(SavedTensorFacts(big, parameter=True, context=True)) is Decision.PARAMETER
    assert decide(SavedTensorFacts(big, context=True)) is Decision.CONTEXT
    assert decide(SavedTensorFacts(big, parameter=True, supported=False)) is Decision.UNSUPPORTED
    assert decide(SavedTensorFacts(10), min_bytes=0) is Decision.OFFLOAD


def test_transfer_seconds() -> None:
    assert transfer_seconds(1 << 30, 1 << 30) == 1.0
    assert transfer_seconds(0, 0.0, per_tensor_s=0.5, tensors=2) == 1.0
    assert math.isinf(transfer_seconds(1, 0.0))
    bandwidth = Bandwidth("disk", 1 << 20, 1e9, 2e9, 1e-4)
    assert bandwidth.seconds(int(2e9), tensors=10) == 2.0 + 1e-3 + 1.0


def test_stats_properties() -> None:
    group = GroupStats(0, 5, 2, 100, 10, {"SMALL": 3, "PARAMETER": 4})
    assert group.kept_bytes == 7
    stats = OffloadStats("disk", {0: group}, 0, 0, 0, 0, 100, 0.5, 50, 0.25, 0.0, 0.0, 0, 0, None)
    assert stats.write_bandwidth == 200 and stats.read_bandwidth == 200
    idle = OffloadStats("disk", {}, 0, 0, 0, 0, 0, 0.0, 0, 0.0, 0.0, 0.0, 0, 0, None)
    assert idle.write_bandwidth == 0.0 and idle.read_bandwidth == 0.0
