"""Pure decision code: Genoa, Flow, and the step recorder (no tensors involved)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorscope.graph import NextUse, Recorder, next_use_table
from tensorscope.policies import Action, Entry, Flow, Genoa, OpView, Snapshot


def _entry(
    key: int, nbytes: int, next_use: int | None, last_use: int = 0, busy: bool = False
) -> Entry:
    return Entry(key, nbytes, "device", last_use, next_use, busy)


def test_genoa_demotes_operands_and_results_once_each() -> None:
    actions = Genoa().after_op(OpView("add", operands=(1, 2, 1), results=(3,)))
    assert actions == [Action("demote", 1), Action("demote", 2), Action("demote", 3)]


def test_genoa_evicts_least_recently_used_and_never_busy_entries() -> None:
    snap = Snapshot(
        100,
        100,
        9,
        (_entry(1, 40, None, 5), _entry(2, 40, None, 1), _entry(3, 40, None, 0, busy=True)),
    )
    assert Genoa().evict(snap, 30) == [2]
    assert Genoa().evict(snap, 60) == [2, 1]


def test_flow_evicts_farthest_next_use_first_unknown_counting_as_never() -> None:
    snap = Snapshot(
        100,
        100,
        9,
        (_entry(1, 30, 12), _entry(2, 30, None), _entry(3, 30, 40), _entry(4, 30, 11, busy=True)),
    )
    assert Flow().evict(snap, 50) == [2, 3]


def test_flow_prefetches_into_headroom_then_only_past_farther_entries() -> None:
    resident = (_entry(1, 40, 50), _entry(2, 40, 3))
    upcoming = (
        Entry(7, 20, "disk", 0, 2, False),
        Entry(8, 40, "disk", 0, 4, False),
        Entry(9, 40, "disk", 0, 60, False),
    )
    snap = Snapshot(100, 80, 1, resident, upcoming)
    actions = Flow().after_op(OpView("mm", (), (), snap))
    # 7 fits the 20 free bytes; 8 needs 40: evict 1 (next use 50 > 4), not 2 (3 < 4);
    # 9 (next use 60) is needed later than anything resident: not prefetched.
    assert actions == [Action("prefetch", 7), Action("demote", 1), Action("prefetch", 8)]


def test_flow_prefetches_at_most_prefetch_limit_placements_after_an_op() -> None:
    upcoming = tuple(Entry(k, 10, "disk", 0, k, False) for k in range(10, 16))
    snap = Snapshot(1000, 0, 1, (), upcoming)  # room for all six
    assert [a.key for a in Flow().after_op(OpView("mm", (), (), snap))] == [10, 11, 12, 13]
    assert [a.key for a in Flow(prefetch_limit=1).after_op(OpView("mm", (), (), snap))] == [10]


def _paced(etas: list[float], nbytes: int = 100, tier: str = "disk") -> tuple[Entry, ...]:
    return tuple(Entry(k, nbytes, tier, 0, k, False, eta) for k, eta in enumerate(etas, 10))


def test_flow_prefetches_as_far_ahead_as_the_measured_pace_requires() -> None:
    """A placement is asked for now when the disk needs more than half the compute time left
    until its use to deliver it and what comes before it (100 bytes each here)."""
    etas = [0.1, 0.2, 0.3, 5.0, 6.0, 7.0]
    slow = Snapshot(10_000, 0, 1, (), _paced(etas), read_rate=100.0)  # 1 s per placement
    fast = Snapshot(10_000, 0, 1, (), _paced(etas), read_rate=1e6)  # a warm page cache
    assert [e.key for e in Flow().window(slow)] == [10, 11, 12, 13, 14, 15]
    assert [e.key for e in Flow().window(fast)] == [10]  # the next one only
    # 200 bytes/s: the 4th (400 bytes queued, 4 s of reading) is due in 5 s: it can wait.
    medium = Snapshot(10_000, 0, 1, (), _paced(etas), read_rate=200.0)
    assert [e.key for e in Flow().window(medium)] == [10, 11, 12]
    # Nothing measured yet: 4 placements; a fixed limit ignores the pace.
    unmeasured = Snapshot(10_000, 0, 1, (), _paced(etas))
    assert len(Flow().window(unmeasured)) == 4
    assert len(Flow(prefetch_limit=2).window(slow)) == 2


def test_flow_prefetches_the_paced_window_within_the_budget() -> None:
    snap = Snapshot(400, 100, 1, (), _paced([0.1] * 6), read_rate=100.0)
    actions = Flow().after_op(OpView("mm", (), (), snap))
    # All six are due (the disk is slow), 300 bytes of headroom: three fit, nothing to evict.
    assert actions == [Action("prefetch", k) for k in (10, 11, 12)]


def test_recorder_times_the_previous_iteration() -> None:
    recorder = Recorder()
    for it in range(2):
        for index, name in enumerate(["embed", "mm", "mm2", "add", "sum"]):
            recorder.record(name, (name,), at=100.0 * it + index)
    recorder.record("embed", ("embed",), at=300.0)  # a third iteration starts
    assert recorder.seconds_until(3) == 3.0  # op 3 came 3 s after op 0 last time
    assert recorder.seconds_until(0) is None  # not ahead


def test_flow_without_a_prediction_does_nothing_after_ops() -> None:
    assert Flow().after_op(OpView("mm", (1,), (2,), Snapshot(10, 0, 0, ()))) == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.one_of(st.none(), st.integers(0, 100)), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 256),
)
def test_evictions_free_enough_when_possible_and_never_touch_busy(
    raw: list[tuple[int, int | None, bool]], needed: int
) -> None:
    entries = tuple(_entry(i, n, nu, busy=b) for i, (n, nu, b) in enumerate(raw))
    snap = Snapshot(None, sum(e.nbytes for e in entries), 0, entries)
    idle = sum(e.nbytes for e in entries if not e.busy)
    for policy in (Flow(), Genoa()):
        chosen = policy.evict(snap, needed)
        assert len(set(chosen)) == len(chosen)
        by_key = {e.key: e for e in entries}
        assert all(not by_key[k].busy for k in chosen)
        freed = sum(by_key[k].nbytes for k in chosen)
        assert freed >= min(needed, idle)


def test_next_use_table_and_lookups() -> None:
    ops = [("w1", "x"), ("w2",), ("w1",), ()]
    assert next_use_table(ops) == {"w1": [0, 2], "x": [0], "w2": [1]}
    nu = NextUse(ops)
    assert (nu.after("w1", -1), nu.after("w1", 0), nu.after("w1", 2)) == (0, 2, None)
    assert nu.upcoming(0, 10) == ["w2", "w1"]


def test_recorder_detects_repeated_iterations_and_predicts_next_uses() -> None:
    recorder = Recorder()
    iteration = [
        ("embed", ("wte",)),
        ("mm", ("w1",)),
        ("mm", ("w2",)),
        ("mm", ("wte",)),
        ("add", ()),
    ]
    for name, keys in iteration:
        recorder.record(name, keys)
    assert not recorder.predicting
    recorder.record(*iteration[0])  # the start comes again: a new iteration, predicted
    assert recorder.iterations == 1 and recorder.predicting
    assert recorder.next_use("w2") == 2 and recorder.next_use("wte") == 3
    assert recorder.upcoming(2) == ["w1", "w2"]


def test_recorder_stops_predicting_when_the_step_diverges_and_recovers() -> None:
    recorder = Recorder()
    for _ in range(2):
        for name, keys in [("a", ("k",)), ("b", ()), ("c", ()), ("d", ())]:
            recorder.record(name, keys)
    assert recorder.predicting
    recorder.record("zzz", ())  # not what the last iteration did next
    assert not recorder.predicting and recorder.next_use("k") is None
    recorder.boundary()  # an explicit boundary (an optimizer step) starts afresh
    assert recorder.predicting


@pytest.mark.strict
def test_a_users_own_policy_object_drives_the_manager() -> None:
    import torch

    import tensorscope as ts

    class KeepNothing:
        """Demotes every operand and result after each op, like Genoa, written by a user."""

        def __init__(self) -> None:
            self.ops: list[str] = []

        def evict(self, snapshot: Snapshot, needed_bytes: int) -> list[int]:
            return [e.key for e in snapshot.entries if not e.busy]

        def after_op(self, op: OpView) -> list[Action]:
            self.ops.append(op.name)
            return [Action("demote", key) for key in (*op.operands, *op.results)]

    mine = KeepNothing()
    ts.residency.configure(policy=mine, budget="1MiB")
    t = ts.ref(torch.ones(1024))
    t.demote()
    with ts.scope():
        u = t * 3
        below = ts.residency.tiers[1]  # "disk" below the CPU
        assert t.tier == below and u.tier == below
        assert u.sum().item() == 3072
    assert mine.ops and "aten.mul.Tensor" in mine.ops[0]


def test_a_policy_must_have_evict_and_after_op() -> None:
    import tensorscope as ts

    with pytest.raises(ts.ArgumentTypeError, match="Policy object"):
        ts.residency.configure(policy=object())  # type: ignore[arg-type]
    with pytest.raises(ts.InvalidArgumentError, match="unknown policy"):
        ts.residency.configure(policy="lru")


def test_a_workload_that_never_repeats_keeps_a_bounded_trace(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import tensorscope.graph.record as record

    monkeypatch.setattr(record, "MAX_ITERATION_OPS", 10)
    recorder = Recorder()
    for index in range(35):
        recorder.record(f"op{index}", (index,))  # never the same op twice
    assert len(recorder.current) < 10 and recorder.iterations == 3
