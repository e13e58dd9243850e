"""The measured pace that sets Flow's prefetch depth: the disk's read rate and the compute clock
(residency/pace.py), stamped on each recorded op and handed to the policy with each upcoming
placement (its ``eta``)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.residency import room
from tensorscope.residency.pace import PAGE_CACHE_RATE, Pace

MiB = 1 << 20


def test_the_read_rate_averages_disk_reads_and_ignores_page_cache_hits() -> None:
    pace = Pace()
    pace.read(100 * MiB, 1.0)
    assert pace.read_rate == pytest.approx(100 * MiB)
    pace.read(64 * 1024, 1e-6)  # too small to time the disk
    pace.read(64 * MiB, 64 * MiB / (2 * PAGE_CACHE_RATE))  # served by the page cache
    assert pace.read_rate == pytest.approx(100 * MiB)
    pace.read(300 * MiB, 1.0)  # moves a quarter of the way towards the new rate
    assert pace.read_rate == pytest.approx(150 * MiB)


def test_the_compute_clock_leaves_out_the_time_spent_waiting_for_reads() -> None:
    pace = Pace()
    before, wall = pace.clock(), time.perf_counter()
    pace.stalled(5.0)
    assert pace.clock() - before == pytest.approx(time.perf_counter() - wall - 5.0, abs=0.01)


def test_upcoming_placements_carry_the_compute_time_until_their_use() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))  # 1 MiB weights
    ts.residency.configure(policy="flow", budget=3 * MiB)
    seen: list[tuple[float | None, ...]] = []

    def look_ahead(module: nn.Module, args: object) -> None:
        manager = ts.residency
        snapshot = room.snapshot(
            manager.ledger, manager.recorder(), manager.budget_bytes, manager.clock, True, 1.0
        )
        seen.append(tuple(entry.eta for entry in snapshot.upcoming))

    model[1].register_forward_pre_hook(look_ahead)
    x = torch.randn(4, 512)
    with ts.manage(model), torch.no_grad():
        for _ in range(3):
            model(x)
    assert seen[0] == ()  # nothing recorded yet: no prediction
    etas = seen[-1]
    assert etas, "the previous iteration predicts the placements still to come"
    assert all(eta is not None and eta >= 0 for eta in etas)
    assert list(etas) == sorted(etas)  # nearest use first
