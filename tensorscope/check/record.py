"""Check 2: ``ts.record``'s peak against the allocator's, for a GPT-2 training step (AdamW).

On CUDA, after a warm-up step (optimizer state, cuBLAS's workspaces: NOTE [cuBLAS workspaces]
in measure.py) and ``reset_peak_memory_stats``, the step runs under ``ts.record`` with the
allocator read at each phase's end (forward, backward, optimizer step), once with AdamW's
``foreach=True`` (the default on CUDA) and once with ``foreach=False``. It compares:

- what the step added above its start: ``plan.peak_bytes`` minus the bytes alive at its first
  op, against ``max_memory_allocated`` minus ``memory_allocated`` at the start (within 2%);
- the whole: ``plan.peak_bytes`` plus cuBLAS's workspaces against ``max_memory_allocated``
  (within 2%); the evidence splits what the allocator held at the start but no tensor of the
  step did (the workspaces, given back and measured, and anything else);
- per phase, the same above-start comparison;
- the allocator's own history of the step (``torch.cuda.memory._record_memory_history``): the
  blocks alive at its peak that the step allocated, by the Python line that allocated them,
  and the blocks that existed before it (the workspaces among them); requested against
  allocated bytes (the allocator's rounding).

On the CPU the reference is torch's profiler (``profile_memory=True``), as in
tests/plan/test_record.py.

Layer: the check package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import tensorscope as ts
from tensorscope.check.context import Context
from tensorscope.check.measure import gpt2, profiler_peak, sync, tokens, workspace_bytes

__all__ = ["run"]

PHASES = ("forward", "backward", "optimizer")
_NO_FRAME = "(no Python frame)"


def run(ctx: Context) -> None:
    for label, foreach in (("foreach=True", True), ("foreach=False", False)):
        _variant(ctx, label, foreach)


def _model(ctx: Context) -> tuple[torch.nn.Module, torch.Tensor]:
    if ctx.small:
        model = gpt2(2, 64, 2, 512, 64, ctx.device)
        ids = tokens(2, 32, 512, ctx.device)
    else:  # the first probe's shape
        model = gpt2(4, 256, 4, 4096, 256, ctx.device)
        ids = tokens(4, 128, 4096, ctx.device)
    return model, ids


def _variant(ctx: Context, label: str, foreach: bool | None) -> None:
    model, ids = _model(ctx)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
    device = ctx.device
    phases: dict[str, tuple[int, int]] = {}

    def measure(phase: str) -> None:
        if ctx.cuda:
            sync(device)
            phases[phase] = (
                torch.cuda.max_memory_allocated(device),
                torch.cuda.memory_allocated(device),
            )
            torch.cuda.reset_peak_memory_stats(device)

    def step(at: Callable[[str], None]) -> None:
        loss = model(ids, labels=ids).loss
        at("forward")
        loss.backward()
        at("backward")
        opt.step()
        opt.zero_grad()
        at("optimizer")

    step(lambda phase: None)  # warm-up: the optimizer's state, cuBLAS's workspaces
    step(lambda phase: None)
    if not ctx.cuda:
        _on_cpu(ctx, label, step)
        return
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    history = _start_history()
    with ts.record() as rec:
        step(measure)
    events = _stop_history(history)
    plan = rec.plan()
    workspaces = workspace_bytes(device)
    existing = sum(life.nbytes for life in plan.lifetimes if life.created < 0)
    peak = max(high for high, _ in phases.values())
    prefix = f"{label}: "
    ctx.note(prefix + "plan", {
        "peak_bytes": plan.peak_bytes, "peak_phase": plan.peak_phase,
        "peak_site": plan.peak_site, "at_peak": plan.at_peak, "existing_bytes": existing,
    })  # fmt: skip
    ctx.note(prefix + "allocator", {
        "allocated_at_start": start, "max_allocated": peak,
        "untracked_at_start": start - existing, "cublas_workspaces": workspaces,
        "untracked_beyond_workspaces": start - existing - workspaces,
        "plan_peak_over_max_allocated": plan.peak_bytes / peak,
    })  # fmt: skip
    above_plan, above_measured = plan.peak_bytes - existing, peak - start
    ratio = above_plan / above_measured if above_measured else float("nan")
    ctx.expect(
        prefix + "plan peak above the step's start / allocator's (max_allocated - start)",
        0.98 <= ratio <= 1.02,
        f"{ratio:.4f} ({above_plan} / {above_measured} B)",
        "0.98-1.02",
    )
    whole = (plan.peak_bytes + workspaces) / peak
    ctx.expect(
        prefix + "(plan.peak_bytes + cuBLAS workspaces) / max_memory_allocated",
        0.98 <= whole <= 1.02,
        f"{whole:.4f} (plan {plan.peak_bytes} + workspaces {workspaces} vs {peak} B)",
        "0.98-1.02",
    )
    ctx.note(prefix + "per phase, bytes above the start: plan peak / allocator peak; "
             "plan at its end / allocator at its end", {
        phase: [_phase_bytes(plan, phase, max) - existing, phases[phase][0] - start,
                _phase_bytes(plan, phase, _last) - existing, phases[phase][1] - start]
        for phase in PHASES if phase in phases
    })  # fmt: skip
    stats = torch.cuda.memory_stats(device)
    ctx.note(prefix + "memory_stats", {
        key: stats.get(key) for key in (
            "requested_bytes.all.peak", "allocated_bytes.all.peak", "active_bytes.all.peak",
            "reserved_bytes.all.peak", "num_alloc_retries", "num_ooms",
        )
    })  # fmt: skip
    if events is not None:
        ctx.note(prefix + "allocator history", events)


def _on_cpu(ctx: Context, label: str, step: Callable[[Callable[[str], None]], None]) -> None:
    with ts.record() as rec:
        step(lambda phase: None)
    plan = rec.plan()
    existing = sum(life.nbytes for life in plan.lifetimes if life.created < 0)
    measured = profiler_peak(lambda: step(lambda phase: None))
    ratio = (plan.peak_bytes - existing) / measured if measured else float("nan")
    ctx.note(
        f"{label}: plan",
        {
            "peak_bytes": plan.peak_bytes,
            "existing_bytes": existing,
            "peak_phase": plan.peak_phase,
            "profiler_peak": measured,
        },
    )
    ctx.expect(
        f"{label}: plan peak above the step's start / profiler's allocation peak",
        0.98 <= ratio <= 1.02,
        f"{ratio:.4f}",
        "0.98-1.02",
    )


def _phase_bytes(plan: ts.MemoryPlan, phase: str, pick: Callable[[list[int]], int]) -> int:
    """The plan's bytes over the ops of ``phase``: ``max`` (its peak) or ``_last`` (its end)."""
    rows = [sum(row[2].values()) for row in plan.timeline if plan.ops[row[0]].phase == phase]
    return pick(rows) if rows else 0


def _last(values: list[int]) -> int:
    return values[-1]


# ------------------------------------------------------------------ the allocator's history
def _start_history() -> bool:
    try:
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    except Exception:  # evidence only
        return False
    return True


def _stop_history(started: bool) -> dict[str, Any] | None:
    if not started:
        return None
    try:
        snapshot: Any = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return _peak_blocks(snapshot)


def _peak_blocks(snapshot: Any) -> dict[str, Any]:
    """Replay the step's allocations: at the allocator's highest point, which blocks the step
    had allocated (grouped by the innermost Python line) and how many bytes were older."""
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[0]
    alive: dict[int, tuple[int, str]] = {}
    total = high = 0
    at_high: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            alive[addr] = (size, _where(event.get("frames") or []))
            total += size
            if total > high:
                high, at_high = total, dict(alive)
        elif action == "free_requested" and addr in alive:
            total -= alive.pop(addr)[0]
    by_line: dict[str, int] = {}
    frameless: list[int] = []  # autograd's device thread runs no Python: the backward's blocks
    for size, where in at_high.values():
        by_line[where] = by_line.get(where, 0) + size
        if where == _NO_FRAME:
            frameless.append(size)
    largest = sorted(by_line.items(), key=lambda item: -item[1])[:12]
    made = {event.get("addr") for event in trace if event.get("action") == "alloc"}
    older = []
    for segment in snapshot.get("segments", []):
        address = int(segment.get("address", 0))
        for block in segment.get("blocks", []):
            address = int(block.get("address", address))
            if block.get("state") == "active_allocated" and address not in made:
                older.append(int(block.get("size", 0)))
            address += int(block.get("size", 0))
    return {
        "events": len(trace),
        "step_high_bytes": high,
        "at_high_by_line": dict(largest),
        "largest_at_high_without_a_python_frame": sorted(frameless, reverse=True)[:8],
        "blocks_from_before_the_step": len(older),
        "largest_from_before_the_step": sorted(older, reverse=True)[:8],
    }


def _where(frames: list[dict[str, Any]]) -> str:
    for frame in frames:  # innermost first
        name = str(frame.get("filename", ""))
        if "tensorscope/plan" in name or "tensorscope/_" in name:
            continue  # the recorder's own frames
        return f"{name.rsplit('/', 2)[-1]}:{frame.get('line')} {frame.get('name')}"
    return _NO_FRAME
