"""``plan.what_if(...)``: the peak after a change, predicted from the lifetimes, without a rerun.

Pure Python, no torch.

# NOTE [moving intervals]
# Every storage is an interval of op positions on the plan's device. A change moves intervals
# and adds new ones, and the prediction is the highest sum over the result. A position is a
# tuple ``(op, slot, k)``, in this order around op ``i``: ``(i, -2, 0)`` the moment before op
# ``i`` when what was freed since op ``i - 1`` is gone (a recorded storage freed before op
# ``i`` ends there); ``(i, -1, k)`` the ``k``-th op of a recomputation, or a reload, inserted
# just before op ``i``; ``(i, 0, 0)`` op ``i`` as recorded (a storage it made starts there);
# ``(i, 1, k)`` the ``k``-th op of a parameter's update moved right after op ``i``; ``(i, 2, 0)``
# just after that update.
#
# - Freeing gradients at their update (optimizer-in-backward): a gradient ends right after
#   its parameter's update, which moves to the op where autograd last wrote the gradient; the
#   update's temporaries and any optimizer state it creates move with it (an optimizer op's
#   results belong to a parameter: recorder's ``owner``). A gradient that existed before the
#   step would not exist at all.
# - Recomputing a block (``torch.utils.checkpoint``): what its forward made and kept for
#   backward dies after its last forward use instead; at its backward's first op its forward
#   runs again (every storage it made, in the recorded order: temporaries die within the
#   replay, kept ones live to their recorded end); its inputs stay alive until its backward
#   ends (the checkpoint keeps them).
# - Offloading a block's saved activations: each leaves the device after its last forward use
#   and is back on it from its first backward use (the prefetch lead is not modelled).
# - FSDP2's ``reshard_after_forward`` (issue 28): the parameters a group gathers whole
#   (``unsharded_parameter``). False: a group's gather in the forward that was freed in the
#   forward (resharded) stays to the end of the same group's gather in the backward, which is
#   then not made -- paired in reverse order, by size (FSDP2 gathers the groups in the backward
#   in the reverse of the forward's order; each gathered storage, the flat buffer and the
#   parameters' own, is paired with its like). True: a gather of the forward
#   that stayed into the backward leaves after its last forward use and is made again at its
#   first backward use. Only memory: the gathers' time is not predicted.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorscope._units import format_bytes
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError
from tensorscope.plan.data import CATEGORIES, categories_of

if TYPE_CHECKING:
    from tensorscope.plan.model import BlockCall, Lifetime, MemoryPlan

__all__ = ["Prediction", "peak_of", "predict", "resolve_blocks"]

Position = tuple[int, int, int]
Interval = tuple[Position, Position, int, int]  # start, end (exclusive), nbytes, category


@dataclass(frozen=True)
class Prediction:
    """What ``plan.what_if(...)`` predicts.

    Attributes:
        peak_bytes: the predicted peak (bytes on the plan's device).
        at_peak: bytes per category at that peak (summing to ``peak_bytes``).
        saved_bytes: ``plan.peak_bytes - peak_bytes``.
        changes: what was assumed, one line per change.
        notes: caveats (gradients read by ``clip_grad_norm_``, blocks without a backward).
    """

    peak_bytes: int
    at_peak: dict[str, int]
    saved_bytes: int
    changes: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def __str__(self) -> str:
        lines = [
            f"predicted peak {format_bytes(self.peak_bytes)} "
            f"({format_bytes(self.saved_bytes)} less than recorded)"
        ]
        lines += [f"  - {change}" for change in self.changes]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def peak_of(intervals: Iterable[Interval], n_categories: int) -> tuple[int, list[int]]:
    """The highest total of the intervals alive at once, and its split by category.

    Example:
        >>> peak_of([((0, 0, 0), (2, -2, 0), 10, 0), ((1, -1, 0), (1, 0, 0), 5, 1)], 2)
        (15, [10, 5])
    """
    events: list[tuple[Position, int, int, int]] = []
    for start, end, nbytes, category in intervals:
        if end > start and nbytes:
            events.append((start, 1, nbytes, category))
            events.append((end, 0, -nbytes, category))
    events.sort()
    running = [0] * n_categories
    best, best_split = 0, [0] * n_categories
    i = 0
    while i < len(events):
        position = events[i][0]
        while i < len(events) and events[i][0] == position:  # ends (0) sort before starts (1)
            running[events[i][3]] += events[i][2]
            i += 1
        total = sum(running)
        if total > best:
            best, best_split = total, list(running)
    return best, best_split


def resolve_blocks(plan: MemoryPlan, blocks: Iterable[Any], what: str) -> list[int]:
    """Indices of the (non-recomputed) calls the given blocks name; outermost only."""
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Iterable):
        blocks = [blocks]
    known = plan.blocks
    chosen: set[int] = set()
    for block in blocks:
        path = _path_of(plan, block, what)
        found = [i for i, c in enumerate(plan.calls) if c.path == path and not c.recompute]
        if not found:  # a container that never ran itself: its direct children
            depth = path.count(".") + 1
            found = [
                i
                for i, c in enumerate(plan.calls)
                if not c.recompute and c.path.startswith(path + ".") and c.path.count(".") == depth
            ]
        if not found:
            close = difflib.get_close_matches(path, known, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            sample = ", ".join(repr(b) for b in known[:8]) + (", ..." if len(known) > 8 else "")
            raise InvalidArgumentError(
                f"tensorscope.plan: what_if({what}=...): no block {path!r} ran in the recorded "
                f"step.{hint} Blocks are module paths as model.named_modules() gives them; "
                f"plan.blocks lists those that ran: {sample}"
            )
        chosen.update(found)
    outermost = []
    for i in sorted(chosen):
        parent = plan.calls[i].parent
        while parent >= 0 and parent not in chosen:
            parent = plan.calls[parent].parent
        if parent < 0:
            outermost.append(i)
    return outermost


def _path_of(plan: MemoryPlan, block: Any, what: str) -> str:
    if isinstance(block, str):
        return block
    path = plan.module_ids.get(id(block))
    if path is not None:
        return path
    if type(block).__module__.startswith("torch.nn") or hasattr(block, "named_modules"):
        raise InvalidArgumentError(
            f"tensorscope.plan: what_if({what}=...): this {type(block).__name__} did not run in "
            "the recorded step; name a module that ran (plan.blocks lists their paths)."
        )
    raise ArgumentTypeError(
        f"tensorscope.plan: what_if({what}=...) takes module paths (str) or modules; got "
        f"{type(block).__name__}."
    )


def _freed(op: int) -> Position:
    """Where a storage freed before op ``op`` began ends (see the NOTE)."""
    return (op, -2, 0)


class _Intervals:
    """The plan's storages as movable intervals (see the NOTE)."""

    def __init__(self, plan: MemoryPlan) -> None:
        self.plan = plan
        self.n = len(plan.ops)
        rank = {c: k for k, c in enumerate(CATEGORIES)}
        self.parts: dict[int, list[Interval]] = {}
        for life in plan.lifetimes:
            if life.device != plan.device or not life.nbytes:
                continue
            end = self.n if life.freed is None else life.freed
            start = max(life.created, 0)
            self.parts[life.index] = [
                ((start, 0, 0), _freed(end), life.nbytes, rank[life.category])
            ]
        self.extra: list[Interval] = []

    def life(self, index: int) -> Lifetime:
        return self.plan.lifetimes[index]

    def all(self) -> list[Interval]:
        return [part for parts in self.parts.values() for part in parts] + self.extra


def _unit(name: str, together: Collection[str]) -> str | None:
    for path in together:
        if name == path or name.startswith(path + "."):
            return path
    return None


def _free_gradients(
    state: _Intervals, changes: list[str], notes: list[str], together: Collection[str] = ()
) -> None:
    """``together``: module paths whose parameters are updated together, when the last of
    their gradients lands (ts.fit's in-backward updates, a chain's block at a time): their
    gradients are held until then."""
    plan = state.plan
    update_at: dict[int, int] = {}  # parameter -> op after which its update runs
    grads: list[Lifetime] = []
    for life in plan.lifetimes:
        if life.category != "gradient" or life.owner < 0 or life.index not in state.parts:
            continue
        if life.created < 0:  # would have been freed at its update in the previous step
            state.parts[life.index] = []
            continue
        update_at[life.owner] = max(life.created, life.last_backward_use)
        grads.append(life)
    if together:
        last: dict[str, int] = {}
        units = {g.owner: _unit(g.name, together) for g in grads}
        for owner, unit in units.items():
            if unit is not None:
                last[unit] = max(last.get(unit, -1), update_at[owner])
        for owner, unit in units.items():
            if unit is not None:
                update_at[owner] = last[unit]
    for life in grads:
        at = update_at[life.owner]
        start, _, nbytes, category = state.parts[life.index][0]
        state.parts[life.index] = [(start, (at, 2, 0), nbytes, category)]
    step_end = [-1] * state.n  # op -> end of the optimizer step it belongs to
    for first, stop in plan.optimizer_steps:
        for op in range(first, min(stop, state.n)):
            step_end[op] = stop
    for life in plan.lifetimes:
        if life.index not in state.parts or life.category == "gradient" or life.created < 0:
            continue
        if step_end[life.created] < 0 or life.owner not in update_at:
            continue
        at = update_at[life.owner]
        _, end, nbytes, category = state.parts[life.index][0]
        if life.freed is not None and life.freed <= step_end[life.created]:
            end = (at, 1, life.freed)  # a temporary of the update: it dies within it
        state.parts[life.index] = [((at, 1, life.created), end, nbytes, category)]
    changes.append(
        f"gradients freed as each parameter's update is applied ({len(update_at)} parameters)"
    )
    if plan.gradient_readers:
        names = ", ".join(dict.fromkeys(plan.gradient_readers))
        notes.append(
            f"ops outside backward and the optimizer step read gradients ({names}: e.g. "
            "clip_grad_norm_); updating each parameter in backward would change what they see"
        )


def _kept(plan: MemoryPlan, call: BlockCall, index: int) -> bool:
    life = plan.lifetimes[index]
    f0, f1 = call.forward
    end = len(plan.ops) if life.freed is None else life.freed
    return (
        life.category == "activation"
        and f0 <= life.created < f1
        and end > f1
        and index not in call.outputs
    )


def _recompute(state: _Intervals, calls: list[int], changes: list[str]) -> None:
    plan = state.plan
    for i in calls:
        call = plan.calls[i]
        if call.backward is None:
            continue
        f0, f1 = call.forward
        b0, b1 = call.backward
        for index, parts in state.parts.items():
            life = state.life(index)
            if not parts or not f0 <= life.created < f1:
                continue
            start, end, nbytes, category = parts[0]
            replay = (b0, -1, life.created - f0)
            if _kept(plan, call, index):
                last = max(life.last_forward_use, life.created)
                state.parts[index] = [(start, _freed(last + 1), nbytes, category)]
                state.extra.append((replay, end, nbytes, category))
            else:
                stop = min(end[0], f1) - f0
                state.extra.append((replay, (b0, -1, stop), nbytes, category))
        for index in call.inputs:
            kept = state.parts.get(index)
            if kept and kept[-1][1] < _freed(b1):
                start, _, nbytes, category = kept[-1]
                kept[-1] = (start, _freed(b1), nbytes, category)
        changes.append(f"{call.path or '(the model)'} recomputed in backward")


def _offload(state: _Intervals, calls: list[int], changes: list[str]) -> int:
    plan = state.plan
    moved = 0
    for i in calls:
        call = plan.calls[i]
        below = {call.path} | {c.path for c in plan.calls if c.path.startswith(call.path + ".")}
        for index, parts in state.parts.items():
            life = state.life(index)
            if not parts or life.category != "activation" or len(parts) != 1:
                continue
            if not (set(life.saved_by) & below or _kept(plan, call, index)):
                continue
            start, end, nbytes, category = parts[0]
            away = _freed(max(life.last_forward_use, life.created, 0) + 1)
            back = (life.first_backward_use, -1, 0) if life.first_backward_use >= 0 else end
            if back <= away:
                continue
            state.parts[index] = [(start, away, nbytes, category), (back, end, nbytes, category)]
            moved += nbytes
        changes.append(f"{call.path or '(the model)'}: saved activations offloaded")
    return moved


def _reshard(state: _Intervals, after_forward: bool, changes: list[str], notes: list[str]) -> None:
    plan = state.plan
    phases = [op.phase for op in plan.ops]

    def phase(op: int | None) -> str:
        return "end" if op is None or op >= len(phases) else phases[op]

    gathers = sorted(
        (
            life
            for life in plan.lifetimes
            if life.category == "unsharded_parameter"
            and life.created >= 0
            and len(state.parts.get(life.index, ())) == 1
        ),
        key=lambda life: life.created,
    )
    forward = [g for g in gathers if phase(g.created) == "forward"]
    if not gathers:
        notes.append("no parameters were gathered whole in this step (not FSDP2): nothing moved")
        return
    moved = 0
    if not after_forward:
        resharded = [g for g in forward if phase(g.freed) == "forward"]
        for again in (g for g in gathers if phase(g.created) == "backward"):
            match = next((g for g in reversed(resharded) if g.nbytes == again.nbytes), None)
            if match is None:
                continue
            resharded.remove(match)
            start, _, nbytes, category = state.parts[match.index][0]
            state.parts[match.index] = [(start, state.parts[again.index][0][1], nbytes, category)]
            state.parts[again.index] = []
            moved += 1
        changes.append(
            f"reshard_after_forward=False: parameters gathered in the forward kept to their "
            f"backward, not gathered again ({moved} storages)"
        )
        return
    for g in forward:
        if phase(g.freed) == "forward" or g.first_backward_use < 0:
            continue
        start, end, nbytes, category = state.parts[g.index][0]
        away = _freed(max(g.last_forward_use, g.created) + 1)
        state.parts[g.index] = [
            (start, away, nbytes, category),
            ((g.first_backward_use, -1, 0), end, nbytes, category),
        ]
        moved += 1
    changes.append(
        f"reshard_after_forward=True: parameters gathered in the forward freed after it and "
        f"gathered again for their backward ({moved} storages)"
    )


def predict(
    plan: MemoryPlan,
    *,
    free_gradients: bool = False,
    recompute: Iterable[Any] = (),
    offload: Iterable[Any] = (),
    reshard_after_forward: bool | None = None,
) -> Prediction:
    """The peak after the changes (see ``MemoryPlan.what_if`` and the NOTE)."""
    if not isinstance(free_gradients, bool):
        raise ArgumentTypeError(
            f"tensorscope.plan: what_if(free_gradients=...) takes a bool; got {free_gradients!r}"
        )
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ArgumentTypeError(
            "tensorscope.plan: what_if(reshard_after_forward=...) takes a bool (or None: as "
            f"recorded); got {reshard_after_forward!r}"
        )
    recomputed = resolve_blocks(plan, recompute, "recompute")
    offloaded = resolve_blocks(plan, offload, "offload")
    state = _Intervals(plan)
    changes: list[str] = []
    notes: list[str] = []
    if free_gradients:
        _free_gradients(state, changes, notes)
    if recomputed:
        _recompute(state, recomputed, changes)
    if offloaded:
        _offload(state, offloaded, changes)
    if reshard_after_forward is not None:
        _reshard(state, reshard_after_forward, changes, notes)
    without_backward = [plan.calls[i].path for i in recomputed if plan.calls[i].backward is None]
    if without_backward:
        notes.append(f"no backward ran for {', '.join(without_backward)}: nothing to recompute")
    peak, split = peak_of(state.all(), len(CATEGORIES))
    shown = categories_of(life.category for life in plan.lifetimes)
    return Prediction(
        peak_bytes=peak,
        at_peak={c: split[k] for k, c in enumerate(CATEGORIES) if c in shown},
        saved_bytes=plan.peak_bytes - peak,
        changes=tuple(changes),
        notes=tuple(notes),
    )
