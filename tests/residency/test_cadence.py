"""Flow decides at the recorded iteration's decision points while weights stream (cadence.py's
NOTE [coarse decisions]): fewer decisions, the same results and budget, the same decisions with
the C++ fast path on and off."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.graph.analysis import decision_points
from tensorscope.policies import Action, Entry, Flow, OpView, Snapshot
from tensorscope.residency import native
from tensorscope.residency.cadence import Cadence
from tensorscope.residency.manager import ResidencyManager
from tensorscope.residency.pace import Pace
from tensorscope.residency.prefetch import Prefetcher

NATIVE = native.ENGINE is not None


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(48):  # layers smaller than a stretch (an eighth of the budget)
        layers += [nn.Linear(32, 32), nn.Tanh()]
    return nn.Sequential(*layers)


def _inputs() -> list[torch.Tensor]:
    rng = torch.Generator().manual_seed(1)
    return [torch.randn(2, 32, generator=rng) for _ in range(6)]


def _weights(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _decisions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The manager clocks at which the policy's decision is applied from now on (decided by
    Flow, or remembered from an earlier iteration: cadence.py)."""
    clocks: list[int] = []
    original = ResidencyManager.apply

    def apply(self: ResidencyManager, actions: list[Action]) -> None:
        clocks.append(self.clock)
        original(self, actions)

    monkeypatch.setattr(ResidencyManager, "apply", apply)
    return clocks


def _flow_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[Action]]:
    """The actions of each call to Flow.after_op from now on."""
    calls: list[list[Action]] = []
    original = Flow.after_op

    def after_op(self: Flow, op: OpView) -> list[Action]:
        calls.append(original(self, op))
        return calls[-1]

    monkeypatch.setattr(Flow, "after_op", after_op)
    return calls


def _streamed(policy: Flow, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[Any], int]:
    """(decision clocks, outputs, ops on managed tensors) of six forwards at half the weights."""
    model = _model()
    ts.residency.configure(device="cpu", policy=policy, budget=_weights(model) // 2)
    ts.residency.report(reset=True)
    handle = ts.manage(model)
    clocks = _decisions(monkeypatch)
    clock0 = ts.residency.clock
    with torch.no_grad():
        outputs = [model(x) for x in _inputs()]
    ts.residency.sync_ops()
    ops = ts.residency.clock - clock0
    assert ts.residency.report().tiers["device"].peak_bytes <= _weights(model) // 2
    handle.remove()
    return [c - clock0 for c in clocks], outputs, ops


def _plain() -> list[torch.Tensor]:
    model = _model()
    with torch.no_grad():
        return [model(x) for x in _inputs()]


def test_decision_points_cut_an_iteration_by_bytes_first_used() -> None:
    sizes = {"w1": 10, "w2": 10, "b": 1, "w3": 10}
    ops = [("w1",), (), ("w2", "b"), ("w1",), ("w3",), ("b",)]
    assert decision_points(ops, sizes.__getitem__, 10) == [0, 1, 3, 5]
    assert decision_points(ops, sizes.__getitem__, 1000) == [0]
    assert decision_points([], sizes.__getitem__, 10) == []


def test_flow_asks_for_everything_used_before_the_next_decision() -> None:
    # The disk is fast: by the pace alone only the first would be asked for.
    upcoming = tuple(Entry(k, 10, "disk", -1, k, False, 1.0) for k in range(1, 6))
    for horizon, wanted in ((None, [1]), (3, [1, 2, 3]), (10, [1, 2, 3, 4, 5])):
        snapshot = Snapshot(1000, 0, 0, (), upcoming, read_rate=1e9, horizon=horizon)
        assert [e.key for e in Flow().window(snapshot)] == wanted


@pytest.mark.strict
def test_streamed_weights_decide_at_points_not_after_every_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clocks, outputs, ops = _streamed(Flow(), monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(outputs, _plain(), strict=True))
    per_iteration = ops // 6
    assert per_iteration == 96  # each Linear: t(weight), addmm(bias, x, weight.t())
    # The last three forwards are predicted: Flow decides at the points (about 16 an
    # iteration at half the weights), not after every op.
    steady = [c for c in clocks if c > 3 * per_iteration]  # the first op has clock 1
    assert 3 * 8 <= len(steady) <= 3 * 24, len(steady)
    # The first forward has no prediction: it decides after every op.
    assert len([c for c in clocks if c <= per_iteration]) == per_iteration


@pytest.mark.strict
def test_a_decision_in_a_state_seen_before_is_remembered_not_recomputed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same forward again: each point meets the state of the iteration before, and applies
    # the same actions Flow chose there, without asking it again.
    applied: list[list[tuple[str, Any]]] = []
    original = ResidencyManager.apply

    def apply(self: ResidencyManager, actions: list[Action]) -> None:
        # By parameter name: a second run's placements have other uids.
        roles: list[Any] = [self.ledger.by_uid[a.key].role for a in actions]
        applied.append([(a.kind, role[1]) for a, role in zip(actions, roles, strict=True)])
        original(self, actions)

    monkeypatch.setattr(ResidencyManager, "apply", apply)
    flow_calls = _flow_calls(monkeypatch)
    recalled: list[bool] = []
    recall = Cadence.recall

    def counted(self: Cadence, key: Any) -> list[Action] | None:
        found = recall(self, key)
        recalled.append(found is not None)
        return found

    monkeypatch.setattr(Cadence, "recall", counted)
    _, outputs, _ = _streamed(Flow(), monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(outputs, _plain(), strict=True))
    assert sum(recalled) > 0 and recalled[-1]  # the last forward's points are all recalled
    assert len(flow_calls) + sum(recalled) == len(applied)
    # A recalled plan is what Flow answers in that state: the same run with no memory.
    decided = list(applied)
    assert any(decided[-len(decided) // 6 :])  # the last forward moves weights
    applied.clear()
    asked = len(flow_calls)
    monkeypatch.setattr(Cadence, "recall", lambda self, key: None)
    ts.residency.reset()
    _streamed(Flow(), monkeypatch)
    assert applied == decided
    assert len(flow_calls) - asked == len(decided)  # asked at every point this time


def test_a_decision_the_pace_chose_is_not_remembered() -> None:
    # Upcoming placements used at ops 3, 5 and 9; the next decision point's horizon is op 5.
    upcoming = tuple(
        Entry(k, 10, "disk", -1, use, False, 1.0) for k, use in ((1, 3), (2, 5), (3, 9))
    )
    snapshot = Snapshot(1000, 0, 0, (), upcoming, read_rate=1e9, horizon=5)
    empty = Snapshot(1000, 0, 0, (), upcoming[2:], read_rate=1e9, horizon=5)
    cadence = Cadence()
    due = [Action("prefetch", 1), Action("prefetch", 2)]
    paced = [*due, Action("prefetch", 3)]  # a slow disk asks for op 9's placement now too
    cadence.remember((0, 0, 0, (), 0), due, snapshot)
    cadence.remember((1, 0, 0, (), 0), paced, snapshot)
    cadence.remember((2, 0, 0, (), 0), [Action("prefetch", 3)], empty)  # the next one only
    cadence.remember((3, 0, 0, (), 0), [Action("demote", 7)], snapshot)
    assert cadence.recall((0, 0, 0, (), 0)) == due
    assert cadence.recall((1, 0, 0, (), 0)) is None
    assert cadence.recall((2, 0, 0, (), 0)) == [Action("prefetch", 3)]
    assert cadence.recall((3, 0, 0, (), 0)) == [Action("demote", 7)]
    # The key: the read rate by its octave, with the state and the operands.
    ledger: Any = type("L", (), {"resident_print": 5, "device_total": 7})()
    assert Cadence.key(4, ledger, (1,), 3e9) == Cadence.key(4, ledger, (1,), 3.5e9)
    assert Cadence.key(4, ledger, (1,), 3e9) != Cadence.key(4, ledger, (1,), 7e9)
    assert Cadence.key(4, ledger, (1,), None) != Cadence.key(4, ledger, (2,), None)


@pytest.mark.strict
def test_a_fixed_prefetch_limit_decides_after_every_op(monkeypatch: pytest.MonkeyPatch) -> None:
    clocks, outputs, ops = _streamed(Flow(prefetch_limit=2), monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(outputs, _plain(), strict=True))
    assert len(clocks) == ops


@pytest.mark.strict
def test_the_fast_path_decides_at_the_same_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = []
    for off in (True, False):
        native.disable(off)
        try:
            with monkeypatch.context() as patch:
                runs.append(_streamed(Flow(), patch))
        finally:
            native.disable(False)
        ts.residency.reset()
    (slow_clocks, slow_out, slow_ops), (fast_clocks, fast_out, fast_ops) = runs
    assert slow_ops == fast_ops and slow_clocks == fast_clocks
    assert all(torch.equal(a, b) for a, b in zip(slow_out, fast_out, strict=True))


def test_the_prefetcher_says_when_a_placement_landed() -> None:
    landed: list[object] = []
    done = threading.Event()

    def told(placement: object, event: threading.Event) -> None:
        assert event.is_set()  # its waiters are released first
        landed.append(placement)
        done.set()

    class Region:
        def populate(self, write: bool) -> None:
            pass

    class Placement:
        region = Region()
        written = False

    prefetcher = Prefetcher(Pace(), told)
    try:
        placement: Any = Placement()
        prefetcher.submit(placement, threading.Event())
        assert done.wait(timeout=20)
        assert landed == [placement]
    finally:
        prefetcher.close()


@pytest.mark.strict
def test_two_threads_streaming_their_own_models_stay_exact_within_the_budget() -> None:
    # One cadence serves both threads' ops: each thread's decisions may come at the other's
    # points; results and the budget must not depend on it.
    models = [_model(), _model()]
    budget = sum(_weights(m) for m in models) // 2
    ts.residency.configure(device="cpu", policy="flow", budget=budget)
    ts.residency.report(reset=True)
    expected = _plain()
    results: list[list[torch.Tensor]] = [[], []]
    handles: list[Any] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        handles.append(ts.manage(models[i]))
        start.wait(timeout=60)
        with torch.no_grad():
            for _ in range(3):
                results[i] = [models[i](x) for x in _inputs()]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for got in results:
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert ts.residency.report().tiers["device"].peak_bytes <= budget
    for handle in handles:
        handle.remove()
