"""The count of ops on managed tensors (tensorscope/residency/tally.py): the Python op path
counts one op at a time, the C++ fast path's log is replayed in bulk; the same ops must leave
the same clock, sweeps, iterations, traces, module order and last uses either way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tensorscope.graph.order import ModuleOrder
from tensorscope.graph.record import Recorder
from tensorscope.residency.tally import SWEEP_EVERY, Tally

pytestmark = pytest.mark.engine_independent  # pure bookkeeping: no tensor, no engine


@dataclass
class _Placement:
    uid: int
    role: str
    last_use: int = -1


class _Manager:
    """What a tally calls back: sweeps and iteration ends, noted at the clock they ran."""

    def __init__(self) -> None:
        self.tally = Tally(self.sweep, self.iteration_end)
        self.recorder = Recorder()
        self.order = ModuleOrder(min_bytes=0)
        self.placements = {uid: _Placement(uid, f"w{uid}") for uid in range(1, 7)}
        for placement in self.placements.values():
            self.order.add(placement.role, 1)
        self.sweeps: list[int] = []
        self.iteration_ends: list[int] = []

    def sweep(self) -> None:
        self.tally.swept()
        self.sweeps.append(self.tally.clock)

    def iteration_end(self) -> None:
        self.order.restart()
        self.sweep()
        self.iteration_ends.append(self.tally.clock)

    def one_by_one(self, ops: list[tuple[str, tuple[int, ...]]], times: list[float]) -> None:
        """What oppath.py does per op (``tick``, ``record`` once resident, ``used`` after)."""
        for (func, uids), at in zip(ops, times, strict=True):
            self.tally.tick()
            operands = [self.placements[u] for u in uids]
            self.tally.record(self.recorder, self.order, func, tuple(p.role for p in operands), at)
            self.tally.used(operands)

    def replayed(self, ops: list[tuple[str, tuple[int, ...]]], times: list[float]) -> None:
        """What sync_ops does with the engine's log (res_drain: each uid's last op found)."""
        last: dict[int, int] = {}
        for index, (_, uids) in enumerate(ops):
            for uid in uids:
                last[uid] = index
        log = ([f for f, _ in ops], [u for _, u in ops], times, last)
        self.tally.replay(self.recorder, self.order, self.placements, log)

    def state(self) -> dict[str, Any]:
        recorder = self.recorder
        return {
            "clock": self.tally.clock,
            "since_sweep": self.tally.since_sweep,
            "iteration_ends": len(self.iteration_ends),
            "iterations": recorder.iterations,
            "position": recorder.position,
            "diverged": recorder.diverged,
            "current": (recorder.current.signatures, recorder.current.keys, recorder.current.times),
            "previous": recorder._previous_signatures,
            "order": self.order.upcoming(6),
            "last_uses": {u: p.last_use for u, p in self.placements.items()},
        }


def _forward(step: int) -> list[tuple[str, tuple[int, ...]]]:
    """One forward of a small model: the same ops each time, a different input once."""
    ops = [("embed", (1,)), ("mm", (2,)), ("relu", ()), ("mm", (3,)), ("add", (3, 4))]
    ops += [("mm", (5,)), ("tanh", ()), ("mm", (6,)), ("gelu", ()), ("add", (5, 6))] * 20
    if step == 2:
        ops.insert(4, ("dropout", ()))  # a step that diverges from the one before
    return ops


@pytest.mark.parametrize("stretch", [1, 7, 105, 1000])
def test_the_replay_counts_as_the_op_path_does(stretch: int) -> None:
    """Five forwards (105 ops each: sweeps fall inside iterations; the third diverges), counted
    one by one on one manager and replayed ``stretch`` ops at a time on another."""
    ops = [op for step in range(5) for op in _forward(step)]
    times = [0.001 * i for i in range(len(ops))]
    assert len(ops) > 3 * SWEEP_EVERY
    python, native = _Manager(), _Manager()
    python.one_by_one(ops, times)
    for begin in range(0, len(ops), stretch):
        native.replayed(ops[begin : begin + stretch], times[begin : begin + stretch])
    expected, got = python.state(), native.state()
    assert got == expected
    assert expected["iterations"] == 4 and expected["clock"] == len(ops)
    # Sweeps: the op path's at each SWEEP_EVERY ops; the replay's, where one was due in a
    # stretch, once at its end (a sweep forgets what nothing holds by then: tally.py's NOTE).
    due = {clock for clock in python.sweeps if clock not in python.iteration_ends}
    assert due and all(
        any(clock <= swept < clock + stretch for swept in native.sweeps) for clock in due
    )


def test_a_sweep_and_an_iteration_end_reset_the_count_to_the_next_sweep() -> None:
    manager = _Manager()
    for _ in range(SWEEP_EVERY - 1):
        manager.tally.tick()
    assert manager.sweeps == []
    manager.tally.tick()
    assert manager.sweeps == [SWEEP_EVERY] and manager.tally.since_sweep == 0
    ops = _forward(0) + _forward(0)[:1]
    manager.one_by_one(ops, [0.0] * len(ops))
    assert manager.iteration_ends == [SWEEP_EVERY + len(ops)]
    assert manager.tally.since_sweep == 0  # the new iteration's first op swept
