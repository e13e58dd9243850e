"""``plan.save_snapshot(path)``: the step in PyTorch's memory snapshot format.

``torch.cuda.memory._dump_snapshot`` writes a pickled dict (``segments``: the allocator's state
at the end; ``device_traces``: every ``alloc`` / ``free_requested`` / ``free_completed``);
https://pytorch.org/memory_viz and ``torch.cuda._memory_viz`` (``trace_plot``, ``segment_plot``,
``segsum``, ``trace``, ``memory``) read it. A plan writes the same dict for its step, on any
device: each storage is one allocation at its first op (storages that existed before the step:
at the start) and one free at its last, with the category, the tensor and the user line as
its frames.

# NOTE [addresses]
# A plan knows sizes and lifetimes, not addresses. The viewer needs addresses (it matches frees
# to allocations by them, and the segment view draws them), so a first-fit allocator over one
# growing segment, rounding to 512 bytes as CUDA's caching allocator does, gives each storage an
# address. Fragmentation shown by the segment view is that allocator's, not the real one's.

Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import os
import pickle
from typing import TYPE_CHECKING, Any

from tensorscope.errors import ArgumentTypeError, PlanFileError
from tensorscope.plan.summary import describe

if TYPE_CHECKING:
    from tensorscope.plan.model import Lifetime, MemoryPlan

__all__ = ["check_writable", "save_snapshot", "snapshot_dict"]

_ROUND = 512
_BASE = 0x7F0000000000


class _FirstFit:
    """First-fit addresses in one growing segment (see the NOTE on addresses)."""

    def __init__(self) -> None:
        self.gaps: list[tuple[int, int]] = []  # (offset, size), sorted by offset
        self.top = 0

    def alloc(self, size: int) -> int:
        for i, (offset, gap) in enumerate(self.gaps):
            if gap >= size:
                if gap == size:
                    del self.gaps[i]
                else:
                    self.gaps[i] = (offset + size, gap - size)
                return offset
        offset = self.top
        self.top += size
        return offset

    def free(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self.gaps, (offset, 0))
        self.gaps.insert(i, (offset, size))
        if i + 1 < len(self.gaps) and offset + size == self.gaps[i + 1][0]:
            self.gaps[i] = (offset, size + self.gaps[i + 1][1])
            del self.gaps[i + 1]
        if i > 0 and self.gaps[i - 1][0] + self.gaps[i - 1][1] == offset:
            self.gaps[i - 1] = (self.gaps[i - 1][0], self.gaps[i - 1][1] + self.gaps[i][1])
            del self.gaps[i]
        if self.gaps and self.gaps[-1][0] + self.gaps[-1][1] == self.top:
            self.top = self.gaps.pop()[0]


def _frames(life: Lifetime) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = [
        {"filename": "tensorscope", "line": 0, "name": f"{life.category}: {describe(life)}"}
    ]
    if life.site:
        where, _, function = life.site.partition(" in ")
        filename, _, line = where.rpartition(":")
        frames.append(
            {
                "filename": filename or where,
                "line": int(line) if line.isdigit() else 0,
                "name": function,
            }
        )
    return frames


def snapshot_dict(plan: MemoryPlan) -> dict[str, Any]:
    """The snapshot dict of ``torch.cuda.memory._snapshot()`` for the plan's step."""
    n = len(plan.ops)
    lives = [life for life in plan.lifetimes if life.device == plan.device and life.nbytes]
    starts: dict[int, list[Lifetime]] = {}
    ends: dict[int, list[Lifetime]] = {}
    for life in lives:
        end = n if life.freed is None else life.freed
        start = max(life.created, 0)
        if end <= start:
            continue
        starts.setdefault(start, []).append(life)
        if life.freed is not None:
            ends.setdefault(end, []).append(life)
    arena = _FirstFit()
    placed: dict[int, tuple[int, int, int, list[dict[str, Any]]]] = {}
    trace: list[dict[str, Any]] = []
    for op in range(n + 1):
        time_us = int(plan.ops[op].seconds * 1e6) if op < n else int(plan.seconds * 1e6)
        for life in ends.get(op, ()):
            offset, size, _, frames = placed.pop(life.index)
            arena.free(offset, size)
            for action in ("free_requested", "free_completed"):
                trace.append(_event(action, _BASE + offset, life.nbytes, frames, time_us))
        for life in starts.get(op, ()) if op < n else ():
            size = -(-life.nbytes // _ROUND) * _ROUND
            frames = _frames(life)
            offset = arena.alloc(size)
            placed[life.index] = (offset, size, life.nbytes, frames)
            event = _event("alloc", _BASE + offset, life.nbytes, frames, time_us)
            event["category"] = life.category
            trace.append(event)
    return {"segments": _segments(placed, arena.top), "device_traces": [trace]}


def _event(
    action: str, addr: int, size: int, frames: list[dict[str, Any]], time_us: int
) -> dict[str, Any]:
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": 0,
        "frames": frames,
        "time_us": time_us,
    }


def _segments(
    placed: dict[int, tuple[int, int, int, list[dict[str, Any]]]], top: int
) -> list[dict[str, Any]]:
    """The allocator's state at the end of the step: one segment, its live blocks and gaps."""
    if not placed:
        return []
    blocks: list[dict[str, Any]] = []
    cursor = allocated = requested = 0
    for offset, size, nbytes, frames in sorted(placed.values(), key=lambda item: item[0]):
        if offset > cursor:
            blocks.append({"address": _BASE + cursor, "size": offset - cursor, "state": "inactive"})
        blocks.append(
            {
                "address": _BASE + offset,
                "size": size,
                "requested_size": nbytes,
                "state": "active_allocated",
                "frames": frames,
            }
        )
        allocated += size
        requested += nbytes
        cursor = offset + size
    if cursor < top:
        blocks.append({"address": _BASE + cursor, "size": top - cursor, "state": "inactive"})
    return [
        {
            "device": 0,
            "address": _BASE,
            "total_size": max(top, cursor),
            "allocated_size": allocated,
            "active_size": allocated,
            "requested_size": requested,
            "stream": 0,
            "segment_type": "large",
            "segment_pool_id": (0, 0),
            "blocks": blocks,
        }
    ]


def check_writable(path: Any, what: str) -> str:
    """``path`` as a string, once its directory exists; else the error a user can act on."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"tensorscope.plan: {what} takes a file path (str or os.PathLike); got "
            f"{type(path).__name__}."
        )
    text = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise PlanFileError(
            f"tensorscope.plan: cannot write {text!r}: the directory {folder!r} does not "
            "exist; create it first or choose another path."
        )
    return str(text)


def save_snapshot(plan: MemoryPlan, path: Any) -> None:
    """Write :func:`snapshot_dict` pickled to ``path`` (see the module docstring)."""
    text = check_writable(path, "save_snapshot()")
    data = snapshot_dict(plan)
    try:
        with open(text, "wb") as f:
            pickle.dump(data, f)
    except OSError as error:
        raise PlanFileError(
            f"tensorscope.plan: cannot write the snapshot to {text!r} ({error.strerror or 'error'})"
            f"; choose a writable path."
        ) from error
