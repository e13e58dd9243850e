"""What a plan writes (the PNG, the memory_viz snapshot) and the errors users can meet."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

import tensorscope as ts

from ._support import mlp, mlp_step

pytestmark = pytest.mark.engine_independent  # recordings of plain steps (checked)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# The recorded model lives as long as the module's tests: the plan names modules by id(), and a
# module made later (test_what_if_naming_a_block_that_did_not_run) could otherwise get the id of
# a freed one that ran (seen once under Python 3.12).
_MODELS: list[torch.nn.Module] = []


@pytest.fixture(scope="module")
def plan() -> ts.MemoryPlan:
    torch.set_num_threads(1)
    model = mlp()
    _MODELS.append(model)
    opt = torch.optim.Adam(model.parameters())
    step = mlp_step(model, opt)
    step()
    with ts.record() as rec:
        step()
    return rec.plan()


def test_save_png_writes_a_png(plan: ts.MemoryPlan, tmp_path: Path) -> None:
    import matplotlib.image

    path = tmp_path / "step.png"
    plan.save_png(path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 600 and height > 300
    plan.save_png(str(tmp_path / "titled.png"), title="my step")
    assert (tmp_path / "titled.png").stat().st_size > 10_000


def test_save_png_without_matplotlib_names_the_extra(
    plan: ts.MemoryPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"tensorscope\[plot\]"):
        plan.save_png(tmp_path / "step.png")
    assert not (tmp_path / "step.png").exists()


def test_unwritable_paths_raise_plan_file_error(plan: ts.MemoryPlan, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "step.png"
    with pytest.raises(ts.PlanFileError, match="does not exist") as raised:
        plan.save_png(missing)
    assert isinstance(raised.value, OSError) and isinstance(raised.value, ts.TensorScopeError)
    with pytest.raises(ts.PlanFileError, match="does not exist"):
        plan.save_snapshot(missing.with_suffix(".pickle"))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ts.PlanFileError, match="choose a writable path"):
            plan.save_png(locked / "step.png")
    directory = tmp_path / "a_directory.png"
    directory.mkdir()
    with pytest.raises(ts.PlanFileError, match="choose a writable path"):
        plan.save_snapshot(directory)
    with pytest.raises(ts.ArgumentTypeError):
        plan.save_png(42)


def test_snapshot_loads_in_torchs_memory_viz_tools(plan: ts.MemoryPlan, tmp_path: Path) -> None:
    from torch.cuda import _memory_viz as viz

    path = tmp_path / "step.pickle"
    plan.save_snapshot(path)
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert set(data) == {"segments", "device_traces"}
    summary = viz.segsum(data)  # checks every segment's blocks add up
    assert "segments: 1" in summary
    trace = viz.trace(data)
    allocations = trace.count(" = seg_0[") + trace.count(" = MEM[")
    assert allocations == len(
        [life for life in plan.lifetimes if life.nbytes and life.device == plan.device]
    )
    assert "TOTAL MEM" in trace
    flame = viz.memory(data, format_flamegraph=lambda lines: lines)
    assert "active_allocated" in flame and "parameter" in flame
    assert viz.segments(data, format_flamegraph=lambda lines: lines)
    assert "<!DOCTYPE html>" in viz.trace_plot(data)
    assert "<!DOCTYPE html>" in viz.segment_plot(data)


def test_record_nested_in_itself_is_refused() -> None:
    with ts.record():
        with pytest.raises(ts.PlanError, match="already open on this thread"), ts.record():
            pass
        torch.ones(2).sum()


def test_a_recording_is_used_once() -> None:
    rec = ts.record()
    with rec:
        torch.ones(2).sum()
    with pytest.raises(ts.PlanError, match="already used"), rec:
        pass


def test_plan_before_the_block_ended() -> None:
    rec = ts.record()
    with pytest.raises(ts.PlanError, match=r"before the `with ts\.record"):
        rec.plan()
    with rec:
        torch.ones(2).sum()
        with pytest.raises(ts.PlanError, match=r"inside the `with ts\.record"):
            rec.plan()
    assert rec.plan().peak_bytes == 12  # ones(2) and its sum


def test_a_block_that_ran_no_op() -> None:
    with ts.record() as rec:
        x = [1, 2, 3]
        del x
    with pytest.raises(ts.PlanError, match="ran no torch op"):
        rec.plan()


def test_what_if_naming_a_block_that_did_not_run(plan: ts.MemoryPlan) -> None:
    with pytest.raises(ts.InvalidArgumentError, match=r"no block '9' ran") as raised:
        plan.what_if(recompute=["9"])
    assert isinstance(raised.value, ValueError)
    with pytest.raises(ts.InvalidArgumentError, match="did not run in the recorded step"):
        plan.what_if(offload=[torch.nn.Linear(2, 2)])
    with pytest.raises(ts.ArgumentTypeError):
        ts.record(saved_tensors="no")  # type: ignore[arg-type]


def test_what_if_takes_the_modules_themselves() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = mlp_step(model, opt)
    with ts.record() as rec:
        step()
    plan = rec.plan()
    by_module = plan.what_if(recompute=[model[2], model[3]])
    by_name = plan.what_if(recompute=["2", "3"])
    assert by_module == by_name
