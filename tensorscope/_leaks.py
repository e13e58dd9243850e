"""The leak report of ``ts.scope(report_leaks=True)``: refs still referenced from outside the
scope when it closed, and where each was created."""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

import torch

from tensorscope._reach import objects_in
from tensorscope._sites import format_site
from tensorscope._units import format_bytes
from tensorscope.errors import LeakWarning

if TYPE_CHECKING:
    from tensorscope.scope import DisposeScope

__all__ = ["LeakRecord", "find_leaks", "warn_leaks"]


@dataclass(frozen=True)
class LeakRecord:
    """A ref that was still referenced from outside its scope when the scope closed."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    site: str
    held_by: tuple[str, ...]

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        holders = ", ".join(self.held_by)
        return (
            f"tensor {self.shape} {dtype} ({format_bytes(self.nbytes)}) created at {self.site}, "
            f"held by {holders}"
        )


def find_leaks(
    scope: DisposeScope, frame: FrameType, locals_at_entry: set[int]
) -> list[LeakRecord]:
    """Owned refs of ``scope`` that something outside the scope's own frame still references."""
    # Only the scope's own frame, its locals bound inside the scope and what those locals hold
    # (a dict of lists, a ModelOutput with its cache) may hold a ref without it being a leak;
    # anything else (a list made before the scope, an attribute, a closure cell, a global)
    # would keep the tensor alive beyond the step.
    new_locals = [v for v in frame.f_locals.values() if id(v) not in locals_at_entry]
    ignored = {id(frame), id(frame.f_locals), id(new_locals)}
    inside = _held_by_locals(new_locals, ignored)
    records = []
    for state in scope.owned_states():
        tensor = state()
        if tensor is None:
            continue
        holders = [
            _describe_holder(holder)
            for holder in gc.get_referrers(tensor)
            if not isinstance(holder, FrameType)
            and id(holder) not in ignored
            and id(holder) not in inside
        ]
        if holders:
            records.append(
                LeakRecord(
                    _shape(tensor),
                    tensor.dtype,
                    tensor.numel() * tensor.element_size(),
                    format_site(state.site),
                    tuple(holders),
                )
            )
        del tensor
    return records


def _held_by_locals(new_locals: list[object], ignored: set[int]) -> set[int]:
    """Ids of the scope's new locals, and of the containers and objects reachable from them,
    that nothing else references, directly or through a referrer of their own (a dict
    appended to a list made before the scope is not the scope's: what it holds leaks
    through it)."""
    reachable: dict[int, object] = {}
    for value in new_locals:
        for item in objects_in(value):
            if not isinstance(item, torch.Tensor):
                reachable[id(item)] = item
                attributes = getattr(item, "__dict__", None)
                if isinstance(attributes, dict):  # an object's attributes hold its tensors
                    reachable[id(attributes)] = attributes
    ignored = ignored | {id(reachable), id(new_locals)}  # this function's own bookkeeping
    referrers: dict[int, set[int]] = {}
    for key in list(reachable):  # (not .items(): its iterator keeps the last pair alive)
        found = gc.get_referrers(reachable[key])
        referrers[key] = {
            id(r) for r in found if not isinstance(r, FrameType) and id(r) not in ignored
        }
        del found
    referrers.pop(id(referrers), None)
    inside = set(reachable)
    changed = True
    while changed:  # drop what something outside holds, until nothing changes
        changed = False
        for key in list(inside):
            if not referrers[key] <= inside | {id(referrers)}:
                inside.discard(key)
                changed = True
    return inside


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return (tensor.size(0),) if tensor.is_nested else tuple(tensor.shape)


def warn_leaks(scope_words: str, leaks: list[LeakRecord]) -> None:
    """One LeakWarning listing every leaked ref, pointing at the user's ``with`` line."""
    lines = "\n".join(f"  - {r}" for r in leaks)
    total = format_bytes(sum(r.nbytes for r in leaks))
    warnings.warn(
        f"tensorscope.scope: {scope_words} closed while {len(leaks)} of its tensors "
        f"({total}) were still referenced from outside it. They are disposed now; "
        f"without the scope they would have stayed alive (a leak):\n{lines}",
        LeakWarning,
        stacklevel=4,
    )


def _describe_holder(holder: object) -> str:
    kind = type(holder).__name__
    if isinstance(holder, dict):
        return "a dict (an object attribute or a mapping)"
    return f"a {kind}"
