"""What a recorded step holds outside its block chain, per phase (pure: plain data, no torch).

``ts.fit`` splits a step's memory in two: the block chain, whose memory rotor's schedule
decides (``checkpoint/``), and everything else -- parameters, gradients, optimizer state, the
embedding's and the head's activations, the logits and the loss -- which it reads from the
recorded step (``ts.record``, ``MemoryPlan``). See NOTE [the step around the chain].
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorscope.fit.rows import block_bytes, row_ranges
from tensorscope.plan.data import CATEGORIES
from tensorscope.plan.whatif import Interval, Position, _free_gradients, _Intervals, peak_of

if TYPE_CHECKING:
    from tensorscope.plan.model import Lifetime, MemoryPlan

__all__ = [
    "StepBase",
    "chain_backward_peak",
    "chain_ops",
    "logits_rows",
    "placed_peak",
    "step_base",
]

# NOTE [the step around the chain]
# rotor's chain accounts for what the chain allocates: its input, activations, saved tensors,
# hidden-state gradients, transients, the shared context -- not parameters, their gradients or
# optimizer state. Everything else is read from the recorded step: the storages that no op of
# a chain block made (the chain's own are left out: their memory is the schedule's), with
# model state (parameters, gradients, optimizer state) always counted here. The step is split
# in three regions of ops:
#   under_chain: while the chain's forward or backward runs (what stays allocated under it:
#                model state, the embedding's saved tensors, the mask...);
#   at_loss:     between the chain's forward and its backward (the head, logits, the loss and
#                their gradients): the part above under_chain is rotor's ``loss_tmp``;
#   outside:     before the chain's forward and after its backward (the embedding's backward,
#                the optimizer step).
# The predicted peak is max(outside, under_chain + the schedule's peak), with the schedule's
# peak including loss_tmp where the loss runs -- a sum of two maxima, so it never under-counts
# what the recorded lifetimes say. Optimizer state made in the first step exists from the
# start of every later step, so it is counted from op 0. With ``free_gradients`` the plan's
# what_if model moves each update into the backward, right after its gradient's last write,
# and ends the gradient there (plan/whatif.py, NOTE [moving intervals]).
# With the optimizer state in the next tier between updates (fit/statestore.py), the state is
# resident only while the optimizer step runs (gradients kept: from the step's first op on) or,
# with gradients freed at their update, each parameter's state only at its update (where
# what_if's model moved it; a parameter that gets no gradient is never read back). A parameter
# whose state is split in row blocks (fit/rows.py) is then updated one block at a time: its
# state and its update's temporaries count one block each. With gradients kept and the state
# in the next tier, the store runs `optimizer.step()` one parameter at a time (``stepwise``,
# statestore.py NOTE [a kept-gradient step one parameter at a time]): from the step's first op
# on, one parameter's state is resident -- the largest, or one row block of a split one.
# With the chain's parameters placed in files between their uses (fit/paramplace.py, NOTE
# [parameters between their uses]), those parameters count nowhere but under the chain, where
# one block's (the largest) is mapped at a time: ``placed_window`` bytes over the chain's
# forward and backward.

_ACTIVATION_LIKE = ("activation", "temporary", "other")

# NOTE [the head and its loss in chunks]
# With ts.fit's chunked LM loss (fit/chunkloss.py) the head's logits and their gradients are
# never made: a storage made between the chain's forward and its backward (the loss region)
# whose last dimension is the vocabulary and which holds at least two rows of it is left out,
# and the chunked loss's own memory -- the head weight's gradient in float32, the hidden
# state's gradient and a chunk's logits (twice: in the head's dtype and upcast) -- is counted
# over the whole loss region instead (the decider sizes it: fit/decider.py).


def logits_rows(plan: MemoryPlan, paths: Collection[str], vocab: int) -> int:
    """Rows of the largest logits-like storage of the loss region (NOTE [the head and its loss
    in chunks]); 0 when there is none (no chain, or no such storage).

    Example:
        >>> from tensorscope.plan.model import Lifetime, MemoryPlan, OpInfo
        >>> ops = [OpInfo("mm", 0.0, "", b, ph) for b, ph in
        ...        [("h.0", "forward"), ("head", "forward"), ("h.0", "backward")]]
        >>> logits = Lifetime(0, "temporary", 4 * 6 * 50, 1, 1, 2, "", (4, 6, 50), "f32", "cpu")
        >>> plan = MemoryPlan(0, 1, "", "forward", {}, None, [], [logits], ops, [], [], [],
        ...                   "cpu", 1.0)
        >>> logits_rows(plan, ["h.0"], 50), logits_rows(plan, ["h.0"], 51)
        (24, 0)
    """
    ranges = chain_ops(plan, paths) if paths else None
    if ranges is None:
        return 0
    loss_ops = range(ranges[0].stop, ranges[1].start)
    rows = [math.prod(x.shape[:-1]) for x in plan.lifetimes if _logits_like(x, vocab, loss_ops)]
    return max(rows, default=0)


def _logits_like(life: Lifetime, vocab: int, loss_ops: range) -> bool:
    """Whether ``life`` is the logits, or one of their copies or gradients, of the loss."""
    return (
        life.category in _ACTIVATION_LIKE
        and life.created in loss_ops
        and len(life.shape) >= 2
        and life.shape[-1] == vocab
        and math.prod(life.shape[:-1]) >= 2
    )


@dataclass(frozen=True)
class StepBase:
    """Bytes a step holds outside its chain, per region (NOTE [the step around the chain]).

    Attributes:
        free_gradients: whether gradients are freed at their update (optimizer-in-backward).
        under_chain: highest bytes outside the chain while the chain runs.
        at_loss: highest bytes outside the chain between the chain's forward and backward.
        outside: highest bytes before the chain's forward and after its backward.
        parameter_bytes, gradient_bytes, optimizer_state_bytes: bytes of model state (the
            largest each category reaches in the step).
        seconds: time of the ops outside the chain in the recorded step (recording included),
            plus the optimizer state's transfers when it is offloaded.
        state_offloaded: whether the optimizer state is in the next tier between updates.
        offloaded_bytes: bytes of optimizer state moved out and back each step.
        placed_bytes: bytes of the chain's parameters in files between their uses (0: none).
        chunked_loss: whether the LM head and its loss run in row chunks (NOTE [the head and
            its loss in chunks]).
    """

    free_gradients: bool
    under_chain: int
    at_loss: int
    outside: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    seconds: float
    state_offloaded: bool = False
    offloaded_bytes: int = 0
    placed_bytes: int = 0
    chunked_loss: bool = False

    @property
    def loss_tmp(self) -> int:
        """What the loss region needs above ``under_chain`` (rotor's ``loss_tmp``)."""
        return max(0, self.at_loss - self.under_chain)

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and optimizer state together."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes


def _updated_in_rows(plan: MemoryPlan, block: int) -> set[int]:
    """The parameters (lifetime indices) whose optimizer state the store splits in rows."""
    return {
        life.owner
        for life in plan.lifetimes
        if life.category == "optimizer_state"
        and life.owner >= 0
        and len(row_ranges(life.shape, life.nbytes, block)) > 1
    }


def _in_chain(block: str, paths: Collection[str]) -> bool:
    return any(block == p or block.startswith(p + ".") for p in paths)


def chain_ops(plan: MemoryPlan, paths: Collection[str]) -> tuple[range, range] | None:
    """The op ranges of the chain's forward and backward in ``plan`` (None: no chain op).

    ``paths`` are the module paths of the chain's blocks in the plan (``plan.module_ids``).
    """
    fw = [
        i for i, op in enumerate(plan.ops) if op.phase == "forward" and _in_chain(op.block, paths)
    ]
    bw = [
        i for i, op in enumerate(plan.ops) if op.phase == "backward" and _in_chain(op.block, paths)
    ]
    if not fw:
        return None
    forward = range(fw[0], fw[-1] + 1)
    if not bw:
        return forward, range(forward.stop, forward.stop)
    # block 0's backward runs inside its Function's backward: its ops are named by no module
    stop = bw[-1] + 1
    while stop < len(plan.ops) and plan.ops[stop].phase == "backward" and not plan.ops[stop].block:
        stop += 1
    return forward, range(bw[0], stop)


def _held(plan: MemoryPlan, ops: Iterable[int], log: Sequence[tuple[float, int]]) -> list[Interval]:
    """Per op of ``ops``, the most bytes ``log`` says were held while it ran: ``log`` is
    ``(seconds since the recording began, bytes)`` at each change."""
    times = [op.seconds for op in plan.ops] + [plan.seconds]
    stamps = [t for t, _ in log]
    out: list[Interval] = []
    for i in ops:
        start, stop = times[i], times[i + 1]
        before = bisect.bisect_right(stamps, start) - 1
        held = [log[before][1]] if before >= 0 else []
        held += [b for t, b in log[before + 1 : bisect.bisect_right(stamps, stop)]]
        most = max(held, default=0)
        if most:
            out.append(((i, -2, 0), (i + 1, -2, 0), most, 0))
    return out


def _without(plan: MemoryPlan, placed: Collection[str]) -> list[Interval]:
    """The plan's intervals but those of the parameters named in ``placed``."""
    state = _Intervals(plan)
    names = frozenset(placed)
    out = list(state.extra)
    for index, parts in state.parts.items():
        life = plan.lifetimes[index]
        if not (life.category == "parameter" and life.name in names):
            out.extend(parts)
    return out


def chain_backward_peak(
    plan: MemoryPlan,
    paths: Collection[str],
    ahead: Sequence[tuple[float, int]] = (),
    *,
    placed: Collection[str] = (),
    held: Sequence[tuple[float, int]] = (),
) -> int:
    """The most bytes the recorded step held while its chain's backward ran, with ``ahead``
    added op by op: ``(seconds since the recording began, bytes)`` at each change of what an
    offloader held read back ahead of use (the recording sees such bytes only from their use;
    each op counts the most held while it ran); the parameters named in ``placed`` counted as
    ``held`` says instead (see :func:`placed_peak`). The plan's peak when no chain op is found.

    Example:
        >>> from tensorscope.plan.model import Lifetime, MemoryPlan, OpInfo
        >>> ops = [OpInfo("mm", float(i), "", b, ph) for i, (b, ph) in enumerate(
        ...        [("h.0", "forward"), ("h.0", "backward"), ("h.0", "backward")])]
        >>> lives = [Lifetime(0, "activation", 100, 0, 0, 2, "", (), "f32", "cpu")]
        >>> plan = MemoryPlan(100, 0, "", "forward", {}, None, [], lives, ops, [], [], [],
        ...                   "cpu", 3.0)
        >>> chain_backward_peak(plan, ["h.0"]), chain_backward_peak(plan, ["h.0"], [(1.5, 40)])
        (100, 140)
    """
    ranges = chain_ops(plan, paths) if paths else None
    if ranges is None:
        return plan.peak_bytes
    backward = ranges[1]
    intervals = _without(plan, placed) + _held(plan, backward, ahead) + _held(plan, backward, held)
    return _peak(intervals, [(backward.start, backward.stop)])


def placed_peak(
    plan: MemoryPlan, placed: Collection[str], held: Sequence[tuple[float, int]]
) -> int:
    """The recorded step's peak with the parameters named in ``placed`` (in files between
    their uses: the recording counts their storages whole) counted as what ``held`` says was
    mapped in, op by op (``(seconds since the recording began, bytes)`` at each change).

    Example:
        >>> from tensorscope.plan.model import Lifetime, MemoryPlan, OpInfo
        >>> ops = [OpInfo("mm", float(i), "", "h.0", "forward") for i in range(2)]
        >>> life = lambda i, cat, n, c, f, name: Lifetime(i, cat, n, c, c, f, "", (), "f32",
        ...                                                "cpu", name)
        >>> lives = [life(0, "parameter", 100, -1, None, "h.0.w"), life(1, "activation", 10,
        ...          0, None, "")]
        >>> plan = MemoryPlan(110, 0, "", "forward", {}, None, [], lives, ops, [], [], [],
        ...                   "cpu", 2.0)
        >>> placed_peak(plan, ["h.0.w"], [(0.0, 0), (1.5, 100), (1.8, 0)])
        110
        >>> placed_peak(plan, ["h.0.w"], [(0.0, 0)])
        10
    """
    intervals = _without(plan, placed) + _held(plan, range(len(plan.ops)), held)
    return _peak(intervals, [(0, len(plan.ops))])


def _clip(intervals: list[Interval], first: int, stop: int) -> list[Interval]:
    lo: Position = (first, -2, 0)
    hi: Position = (stop, -2, 0)
    out: list[Interval] = []
    for start, end, nbytes, category in intervals:
        s, e = max(start, lo), min(end, hi)
        if s < e:
            out.append((s, e, nbytes, category))
    return out


def _peak(intervals: list[Interval], ranges: list[tuple[int, int]]) -> int:
    best = 0
    for first, stop in ranges:
        if stop > first:
            best = max(best, peak_of(_clip(intervals, first, stop), len(CATEGORIES))[0])
    return best


def step_base(
    plan: MemoryPlan,
    paths: Collection[str] = (),
    *,
    free_gradients: bool = False,
    offload_state: bool = False,
    state_block: int = 0,
    stepwise: bool = False,
    placed: Collection[str] = (),
    placed_window: int = 0,
    chunked_head: tuple[int, int] | None = None,
) -> StepBase:
    """The step's memory outside the chain whose blocks ran as ``paths`` (none: no chain);
    ``offload_state``: the optimizer state is in the next tier between updates (NOTE [the step
    around the chain]); ``state_block`` (with both): a parameter whose state is split in row
    blocks of that many bytes (fit/rows.py) is updated one block at a time, so its state and its
    update's temporaries count one block each; ``stepwise`` (with ``offload_state``, gradients
    kept): the step updates one parameter at a time, so one parameter's state counts;
    ``placed``: names of parameters in files between their uses, of which ``placed_window``
    bytes are in memory while the chain runs (NOTE [the step around the chain]);
    ``chunked_head=(vocab, extra)``: the LM head and its loss run in row chunks (NOTE [the
    head and its loss in chunks]).

    Example:
        >>> from tensorscope.plan.model import Lifetime, MemoryPlan, OpInfo
        >>> ops = [OpInfo("mm", 0.0, "", b, ph, ) for b, ph in
        ...        [("", "forward"), ("h.0", "forward"), ("head", "forward"),
        ...         ("h.0", "backward"), ("", "backward")]]
        >>> life = lambda i, cat, n, c, f: Lifetime(i, cat, n, c, c, f, "", (), "f32", "cpu")
        >>> lives = [life(0, "parameter", 100, -1, None), life(1, "activation", 10, 1, 4),
        ...          life(2, "temporary", 50, 2, 3)]
        >>> plan = MemoryPlan(160, 2, "", "forward", {}, None, [], lives, ops, [], [], [],
        ...                   "cpu", 1.0)
        >>> base = step_base(plan, ["h.0"])
        >>> base.under_chain, base.at_loss, base.loss_tmp, base.outside
        (100, 150, 50, 100)
        >>> ops.append(OpInfo("add_", 0.0, "", "", "optimizer"))
        >>> lives.append(life(3, "optimizer_state", 200, 5, None))
        >>> import dataclasses
        >>> plan = dataclasses.replace(plan, ops=ops, lifetimes=lives, optimizer_steps=[(5, 6)])
        >>> step_base(plan, ["h.0"]).under_chain
        300
        >>> offloaded = step_base(plan, ["h.0"], offload_state=True)
        >>> offloaded.under_chain, offloaded.outside, offloaded.offloaded_bytes
        (100, 300, 200)
        >>> lives[3] = dataclasses.replace(lives[3], owner=0)  # the state of two parameters
        >>> lives.append(dataclasses.replace(life(4, "optimizer_state", 120, 5, None), owner=1))
        >>> plan = dataclasses.replace(plan, lifetimes=lives)
        >>> step_base(plan, ["h.0"], offload_state=True).outside
        420
        >>> step_base(plan, ["h.0"], offload_state=True, stepwise=True).outside
        300
    """
    state = _Intervals(plan)
    if free_gradients:  # a block's parameters updated together (fit/inbackward.py's NOTE)
        _free_gradients(state, [], [], () if offload_state else paths)
    n = len(plan.ops)
    ranges = chain_ops(plan, paths) if paths else None
    chain_made = set()
    after_chain: Position = (n, -2, 0)
    if ranges is not None:
        forward, backward = ranges
        after_chain = (backward.stop, -2, 0)
        for life in plan.lifetimes:
            if life.category in _ACTIVATION_LIKE and (
                life.created in forward or life.created in backward
            ):
                chain_made.add(life.index)
        if chunked_head is not None:  # NOTE [the head and its loss in chunks]
            loss_ops = range(forward.stop, backward.start)
            chain_made |= {
                life.index
                for life in plan.lifetimes
                if _logits_like(life, chunked_head[0], loss_ops)
            }
    rank = {c: k for k, c in enumerate(CATEGORIES)}
    intervals: list[Interval] = []
    largest = dict.fromkeys(("parameter", "gradient", "optimizer_state"), 0)
    step_start: Position = (plan.optimizer_steps[0][0] if plan.optimizer_steps else n, -2, 0)
    offloaded = 0
    one_at_a_time = offload_state and (free_gradients or stepwise)
    in_rows = _updated_in_rows(plan, state_block) if one_at_a_time else set()
    each: dict[int, int] = {}  # stepwise: a parameter's state bytes (row-capped)
    each_end: Position = step_start
    placed_names = frozenset(placed)
    placed_bytes = 0
    for index, parts in state.parts.items():
        life = plan.lifetimes[index]
        if life.category == "parameter" and life.name in placed_names:
            placed_bytes += life.nbytes
            continue
        if life.owner in in_rows and life.category in ("optimizer_state", "temporary"):
            held = block_bytes(life.shape, life.nbytes, state_block)
            parts = [(a, b, min(c, held), d) for a, b, c, d in parts]
        if index in chain_made:  # the schedule's memory; what outlives the chain stays
            parts = [(max(a, after_chain), b, c, d) for a, b, c, d in parts if b > after_chain]
        elif life.category == "optimizer_state" and life.freed is None and parts:
            first: Position = (0, 0, 0)
            if offload_state:
                offloaded += life.nbytes
                if free_gradients:  # read back for its update only (moved there, or never)
                    start = parts[-1][0]
                    if start[1] == 1:
                        intervals.append(
                            (start, (start[0], 2, 0), parts[-1][2], rank[life.category])
                        )
                    continue
                if stepwise:
                    each[life.owner] = each.get(life.owner, 0) + min(parts[-1][2], life.nbytes)
                    each_end = max(each_end, parts[-1][1])
                    continue
                first = step_start
            parts = [(first, parts[-1][1], life.nbytes, rank[life.category])]
        intervals.extend(parts)
    intervals.extend(state.extra)
    if placed_bytes and ranges is not None:
        for span in ranges:
            if len(span):
                first_op: Position = (span.start, -2, 0)
                after_op: Position = (span.stop, -2, 0)
                intervals.append((first_op, after_op, placed_window, rank["parameter"]))
    if chunked_head is not None and ranges is not None:
        forward, backward = ranges
        loss_start: Position = (forward.stop, -2, 0)
        loss_end: Position = (backward.start, -2, 0)
        intervals.append((loss_start, loss_end, chunked_head[1], rank["temporary"]))
    if each:  # one parameter's state at a time, from the step's first op
        intervals.append((step_start, each_end, max(each.values()), rank["optimizer_state"]))
    for category in largest:  # under FSDP2 a rank's parameters are its shards
        kinds = {rank[category]} | (
            {rank["sharded_parameter"]} if category == "parameter" else set()
        )
        own = [part for part in intervals if part[3] in kinds]
        largest[category] = peak_of(own, len(CATEGORIES))[0]
    chain_s = 0.0
    if ranges is None:
        outside = _peak(intervals, [(0, n)])
        under = at_loss = 0
    else:
        forward, backward = ranges
        outside = _peak(intervals, [(0, forward.start), (backward.stop, n)])
        under = _peak(intervals, [(forward.start, forward.stop), (backward.start, backward.stop)])
        at_loss = _peak(intervals, [(forward.stop, backward.start)])
        times = [op.seconds for op in plan.ops] + [plan.seconds]
        for i in (*forward, *backward):
            chain_s += times[i + 1] - times[i]
    return StepBase(
        free_gradients=free_gradients,
        under_chain=under,
        at_loss=at_loss,
        outside=outside,
        parameter_bytes=largest["parameter"],
        gradient_bytes=largest["gradient"],
        optimizer_state_bytes=largest["optimizer_state"],
        seconds=max(0.0, plan.seconds - chain_s),
        state_offloaded=offload_state,
        offloaded_bytes=offloaded,
        placed_bytes=placed_bytes,
        chunked_loss=chunked_head is not None and ranges is not None,
    )
