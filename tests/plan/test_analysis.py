"""The plan's analysis on hand-made records: no tensors, exact numbers worked out by hand.

Op indices: a storage made by op ``c`` and freed before op ``f`` is alive at ``c .. f - 1``.
"""

from __future__ import annotations

import pickle

import pytest

from tensorscope.errors import ArgumentTypeError, InvalidArgumentError
from tensorscope.plan.analysis import backward_spans, build_plan, categorize, sweep
from tensorscope.plan.data import (
    CallRecord,
    OpRecord,
    StepRecord,
    StorageRecord,
    categories_of,
)
from tensorscope.plan.model import MemoryPlan
from tensorscope.plan.snapshot import snapshot_dict
from tensorscope.plan.summary import summary
from tensorscope.plan.whatif import peak_of

pytestmark = pytest.mark.engine_independent  # recordings of plain steps (checked)


def _ops(phases: str, forward_ops: dict[int, int] | None = None, calls: str = "") -> list[OpRecord]:
    """``phases``: one letter per op (f forward, b backward, o optimizer)."""
    names = {"f": "forward", "b": "backward", "o": "optimizer"}
    forward_ops = forward_ops or {}
    out = []
    for i, letter in enumerate(phases):
        call = int(calls[i]) if calls and calls[i] != "." else -1
        out.append(
            OpRecord(f"aten::op{i}", 0.1 * i, 1, call, names[letter], forward_ops.get(i, -1))
        )
    return out


def _block_step(big_backward_temporary: bool = False) -> StepRecord:
    """A root call (ops 0-3) holding block ``b`` (ops 1-2); backward ops 4-7, where ops 5 and
    6 run b's backward. Storages: input I (5 B), b's saved activation A (50 B, last forward use
    2, first backward use 6, freed before 7), b's temporary T (20 B), b's output O (10 B,
    freed before 5), a loss L (4 B), optionally a backward temporary BT (100 B at op 5)."""
    storages = [
        StorageRecord(5, 0, None, site=1),  # I
        StorageRecord(50, 1, 7, 6, 2, 6, 6, site=1, saved=True, saved_by=(1,), call=1),  # A
        StorageRecord(20, 1, 2, 1, 1, site=1, call=1),  # T
        StorageRecord(10, 2, 5, 4, 3, 4, 4, site=1, call=1),  # O
        StorageRecord(4, 3, None, 4, 3, 4, 4, site=1),  # L
    ]
    if big_backward_temporary:
        storages.append(StorageRecord(100, 5, 6, 5, -1, 5, 5, site=1))  # BT
    return StepRecord(
        ops=_ops("ffffbbbb", {4: 3, 5: 2, 6: 1, 7: 0}, calls="0110...."),
        storages=storages,
        calls=[
            CallRecord("", 0, 4, 0.0, 0.4, -1, (0,), (4,)),
            CallRecord("b", 1, 3, 0.1, 0.3, 0, (0,), (3,)),
        ],
        sites=["", "train.py:7 in step"],
        seconds=0.8,
    )


def _update_step() -> StepRecord:
    """Two parameters P1, P2 (100 B); their gradients G1 (made at op 2) and G2 (op 3); the
    optimizer step (ops 4-5) makes a 10 B temporary for each; zero_grad frees the gradients
    before op 6 (of 7)."""
    return StepRecord(
        ops=_ops("ffbboof"),
        storages=[
            StorageRecord(100, -1, None, 5, 1, role="parameter", name="w1"),
            StorageRecord(100, -1, None, 5, 1, role="parameter", name="w2"),
            StorageRecord(100, 2, 6, 4, -1, 2, 2, role="gradient", owner=0, name="w1"),
            StorageRecord(100, 3, 6, 5, -1, 3, 3, role="gradient", owner=1, name="w2"),
            StorageRecord(10, 4, 5, 4, owner=0),
            StorageRecord(10, 5, 6, 5, owner=1),
        ],
        optimizer_steps=[(4, 6)],
        sites=["", "train.py:9 in step"],
        seconds=0.7,
    )


def test_backward_spans_and_categories() -> None:
    assert backward_spans(["forward", "backward", "backward", "optimizer"]) == [(1, 3)]
    phases = ["forward", "forward", "backward", "backward"]
    spans = backward_spans(phases)
    assert categorize(StorageRecord(8, -1, role="parameter"), phases, spans) == "parameter"
    assert categorize(StorageRecord(8, 0, 1, saved=True), phases, spans) == "activation"
    # kept for backward without a saved-tensor hook (a checkpoint's input, a ctx attribute)
    assert categorize(StorageRecord(8, 0, 3), phases, spans) == "activation"
    assert categorize(StorageRecord(8, 0, 1), phases, spans) == "temporary"
    assert categorize(StorageRecord(8, 0, None), phases, spans) == "other"  # outlived the step
    assert categorize(StorageRecord(8, -1, 3, role="buffer"), phases, spans) == "other"


def test_sweep_counts_each_storage_from_creation_to_free() -> None:
    rows = sweep([(0, 2, 10, 0), (1, 3, 5, 1), (-1, 1, 7, 2)], 3, 3)
    assert rows == [[10, 0, 7], [10, 5, 0], [0, 5, 0]]


def test_plan_of_a_block_step() -> None:
    plan = build_plan(_block_step())
    # op 1: I, A and T alive
    assert (plan.peak_bytes, plan.peak_op, plan.peak_phase) == (75, 1, "forward")
    assert plan.at_peak == {
        "parameter": 0,
        "gradient": 0,
        "optimizer_state": 0,
        "activation": 50,
        "temporary": 20,
        "other": 5,
    }
    assert sum(plan.at_peak.values()) == plan.peak_bytes
    assert [sum(row[2].values()) for row in plan.timeline] == [5, 75, 65, 69, 69, 59, 59, 9]
    assert plan.peak_site == "train.py:7 in step"
    assert [life.category for life in plan.lifetimes] == [
        "other",
        "activation",
        "temporary",
        "activation",  # b's output, freed by the backward: kept for it
        "other",
    ]
    assert plan.lifetimes[1].saved_by == ("b",) and plan.lifetimes[1].block == "b"
    root, block = plan.calls
    assert block.path == "b" and block.forward == (1, 3) and block.backward == (5, 7)
    assert root.backward == (4, 8)
    assert block.saved_bytes == 60  # A and O outlive b's forward
    assert plan.blocks == ["", "b"]
    assert [life.index for life in plan.largest_at_peak(2)] == [1, 2]


def test_what_if_without_changes_is_the_recorded_peak() -> None:
    for record in (_block_step(), _block_step(True), _update_step()):
        plan = build_plan(record)
        prediction = plan.what_if()
        assert prediction.peak_bytes == plan.peak_bytes
        assert prediction.saved_bytes == 0 and prediction.changes == ()


def test_what_if_recompute_replays_the_block_before_its_backward() -> None:
    plan = build_plan(_block_step())
    prediction = plan.what_if(recompute=["b"])
    # A dies after its last forward use (op 2); before op 5, b's forward replays: A again (50)
    # with T (20), over I and L: 79; then T goes and the replayed output comes (69).
    assert prediction.peak_bytes == 79
    assert prediction.at_peak["activation"] == 50 and prediction.at_peak["temporary"] == 20
    assert prediction.saved_bytes == -4
    assert prediction.changes == ("b recomputed in backward",)


def test_what_if_offload_moves_saved_activations_out_until_their_backward() -> None:
    plan = build_plan(_block_step(big_backward_temporary=True))
    assert plan.peak_bytes == 159  # op 5: I, A, L and the backward temporary
    prediction = plan.what_if(offload=["b"])
    assert prediction.peak_bytes == 109  # A is away from op 3 until op 6 needs it
    assert prediction.saved_bytes == 50


def test_what_if_free_gradients_frees_each_at_its_update() -> None:
    plan = build_plan(_update_step())
    assert plan.peak_bytes == 410 and plan.peak_phase == "optimizer"
    prediction = plan.what_if(free_gradients=True)
    # w1's update runs right after op 2 with G1 and its temporary: 100 + 100 + 100 + 10
    assert prediction.peak_bytes == 310
    assert prediction.at_peak["gradient"] == 100
    assert prediction.notes == ()


def test_what_if_notes_ops_that_read_gradients() -> None:
    record = _update_step()
    record.gradient_readers.append("aten::linalg_vector_norm")
    prediction = build_plan(record).what_if(free_gradients=True)
    assert "linalg_vector_norm" in prediction.notes[0]


def test_what_if_names_blocks_and_rejects_unknown_ones() -> None:
    plan = build_plan(_block_step())
    with pytest.raises(InvalidArgumentError, match=r"no block 'c' ran.*plan.blocks"):
        plan.what_if(recompute=["c"])
    with pytest.raises(InvalidArgumentError, match="Did you mean 'b'"):
        plan.what_if(offload="b.")
    with pytest.raises(ArgumentTypeError):
        plan.what_if(recompute=[3.5])
    with pytest.raises(ArgumentTypeError):
        plan.what_if(free_gradients="yes")  # type: ignore[arg-type]
    assert plan.what_if(recompute="b").peak_bytes == 79  # one name, not a list


def test_a_container_stands_for_its_children() -> None:
    record = _block_step()
    record.calls[1].path = "layers.0"
    plan = build_plan(record)
    assert plan.what_if(recompute=["layers"]).peak_bytes == 79


def test_peak_of_counts_frees_before_starts_at_one_position() -> None:
    intervals = [((0, 0, 0), (1, -2, 0), 10, 0), ((1, -1, 0), (2, -2, 0), 7, 1)]
    assert peak_of(intervals, 2) == (10, [10, 0])


def test_plan_is_plain_data() -> None:
    plan = build_plan(_block_step())
    copy = pickle.loads(pickle.dumps(plan))
    assert isinstance(copy, MemoryPlan) and copy.peak_bytes == plan.peak_bytes
    text = summary(plan)
    assert "peak 75 B on cpu at op 1 of 8 (forward), train.py:7 in step" in text
    for category in categories_of(life.category for life in plan.lifetimes):
        assert category in text


def test_snapshot_dict_matches_the_lifetimes() -> None:
    plan = build_plan(_block_step())
    data = snapshot_dict(plan)
    trace = data["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    frees = [e for e in trace if e["action"] == "free_completed"]
    assert sorted(e["size"] for e in allocs) == [4, 5, 10, 20, 50]
    assert sorted(e["size"] for e in frees) == [10, 20, 50]  # I and L outlive the step
    live = 0
    peak = 0
    for event in trace:
        if event["action"] == "alloc":
            live += event["size"]
        elif event["action"] == "free_completed":
            live -= event["size"]
        peak = max(peak, live)
    assert peak == plan.peak_bytes
    (segment,) = data["segments"]
    active = [b for b in segment["blocks"] if b["state"] == "active_allocated"]
    assert sorted(b["requested_size"] for b in active) == [4, 5]
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    frames = allocs[0]["frames"]
    assert frames[0]["name"].startswith("other:") and frames[1]["filename"] == "train.py"
