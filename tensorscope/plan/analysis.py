"""From what the recorder saw to a plan: categories, the sweep over ops, the peak, the blocks.

Pure Python, no torch (tested on hand-made records).

# NOTE [categories]
# One per storage, by the first rule that holds: a parameter of a module that ran (or an
# ``nn.Parameter`` an op used); a parameter's ``.grad``; an optimizer's state; an *activation*:
# autograd saved it for backward (a saved-tensor hook saw it), or it was made in a forward, was
# still alive when a later backward began and was freed during that backward (what
# ``torch.utils.checkpoint`` keeps for its recomputation, what a custom Function keeps on its
# ``ctx``, what a step recorded with ``saved_tensors=False`` saved); a *temporary*: made during
# the step and freed within it; *other*: the rest (buffers, the input batch, outputs that outlive
# the step such as the loss). Under FSDP2 three more (docs/api.md §11): this rank's shard of a
# parameter (``sharded_parameter``), a parameter FSDP2 gathered whole for a while, and the
# flat all-gather buffer (``unsharded_parameter``), the buffer a reduce-scatter reads
# (``reduce_scatter``); gradients and optimizer state are this rank's shards.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorscope.plan.data import CATEGORIES, StepRecord, StorageRecord, categories_of
from tensorscope.plan.model import BlockCall, Lifetime, MemoryPlan, OpInfo

__all__ = ["backward_spans", "build_plan", "categorize", "plan_device", "sweep"]

# roles that are their own category (NOTE [categories])
_OWN_CATEGORY = frozenset(
    (
        "parameter",
        "gradient",
        "optimizer_state",
        "sharded_parameter",
        "unsharded_parameter",
        "reduce_scatter",
    )
)


def backward_spans(phases: Sequence[str]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive backward ops (end exclusive).

    Example:
        >>> backward_spans(["forward", "backward", "backward", "optimizer", "backward"])
        [(1, 3), (4, 5)]
    """
    spans: list[tuple[int, int]] = []
    start = -1
    for i, phase in enumerate(phases):
        if phase == "backward":
            if start < 0:
                start = i
        elif start >= 0:
            spans.append((start, i))
            start = -1
    if start >= 0:
        spans.append((start, len(phases)))
    return spans


def categorize(
    storage: StorageRecord, phases: Sequence[str], spans: Sequence[tuple[int, int]]
) -> str:
    """The category of one storage (see the NOTE on categories).

    Example:
        >>> phases = ["forward", "forward", "backward", "backward"]
        >>> kept = StorageRecord(nbytes=8, created=0, freed=3)
        >>> categorize(kept, phases, backward_spans(phases))
        'activation'
        >>> categorize(StorageRecord(nbytes=8, created=0, freed=1), phases, [(2, 4)])
        'temporary'
    """
    role = storage.role
    if role in _OWN_CATEGORY:
        return role
    if role != "buffer":
        if storage.saved:
            return "activation"
        created, freed = storage.created, storage.freed
        if created >= 0 and freed is not None and phases[created] == "forward":
            for start, end in spans:
                if created < start < freed <= end:
                    return "activation"
    if storage.created >= 0 and storage.freed is not None:
        return "temporary"
    return "other"


def plan_device(storages: Sequence[StorageRecord]) -> str:
    """The device whose memory the plan shows: the one holding the most parameter bytes, else
    the most bytes of all.

    Example:
        >>> plan_device([StorageRecord(4, 0, device="cpu"),
        ...              StorageRecord(8, -1, device="cuda:0", role="parameter")])
        'cuda:0'
    """
    totals: dict[str, tuple[int, int]] = {}
    for s in storages:
        params, every = totals.get(s.device, (0, 0))
        if s.role in ("parameter", "sharded_parameter"):
            params += s.nbytes
        totals[s.device] = (params, every + s.nbytes)
    if not totals:
        return "cpu"
    return max(totals, key=lambda device: totals[device])


def sweep(
    intervals: Sequence[tuple[int, int, int, int]], n_ops: int, n_categories: int
) -> list[list[int]]:
    """Bytes alive per category after each op: ``rows[op][category]``.

    ``intervals``: ``(start, end, nbytes, category)``, alive at ops ``start .. end - 1``.

    Example:
        >>> sweep([(0, 2, 10, 0), (1, 3, 5, 1)], 3, 2)
        [[10, 0], [10, 5], [0, 5]]
    """
    deltas = [[0] * n_categories for _ in range(n_ops + 1)]
    for start, end, nbytes, category in intervals:
        start = max(start, 0)
        end = min(end, n_ops)
        if end > start and nbytes:
            deltas[start][category] += nbytes
            deltas[end][category] -= nbytes
    rows: list[list[int]] = []
    running = [0] * n_categories
    for op in range(n_ops):
        delta = deltas[op]
        running = [a + b for a, b in zip(running, delta, strict=True)]
        rows.append(running)
    return rows


def _at_peak_by_tier(
    record: StepRecord, lifetimes: Sequence[Lifetime], device: str, peak: int, n_ops: int
) -> dict[str, dict[str, int]] | None:
    if not record.tier_changes:
        return None
    tiers: dict[int, str] = {}
    for op, changes in record.tier_changes:
        if op > peak:
            break
        tiers.update(changes)
    shown = categories_of(life.category for life in lifetimes)
    table: dict[str, dict[str, int]] = {"device": dict.fromkeys(shown, 0)}
    for life in lifetimes:
        if life.device == device and life.nbytes and life.alive_at(peak, n_ops):
            tier = tiers.get(life.index, "device")
            row = table.setdefault(tier, dict.fromkeys(shown, 0))
            row[life.category] += life.nbytes
    return table


def _block_calls(
    record: StepRecord, lifetimes: Sequence[Lifetime], end_s: float
) -> list[BlockCall]:
    ops = record.ops
    calls = record.calls
    first = [-1] * len(calls)
    last = [-1] * len(calls)
    for j, op in enumerate(ops):
        if op.phase != "backward" or op.forward_op < 0:
            continue
        call = ops[op.forward_op].call
        while call >= 0:
            if first[call] < 0:
                first[call] = j
            last[call] = j
            call = calls[call].parent

    def time_at(op: int) -> float:
        return ops[op].start_s if op < len(ops) else end_s

    saved = [0] * len(calls)
    for life in lifetimes:
        if life.category != "activation" or life.created < 0:
            continue
        call = ops[life.created].call if life.created < len(ops) else -1
        while call >= 0:
            c = calls[call]
            if c.end >= 0 and (life.freed is None or life.freed > c.end):
                saved[call] += life.nbytes
            call = c.parent
    out = []
    for i, c in enumerate(calls):
        end = c.end if c.end >= 0 else len(ops)
        backward = (first[i], last[i] + 1) if first[i] >= 0 else None
        out.append(
            BlockCall(
                path=c.path,
                forward=(c.start, end),
                backward=backward,
                forward_s=max(0.0, c.end_s - c.start_s),
                backward_s=time_at(backward[1]) - time_at(backward[0]) if backward else 0.0,
                inputs=c.inputs,
                outputs=c.outputs,
                parent=c.parent,
                recompute=c.recompute,
                saved_bytes=saved[i],
            )
        )
    return out


def _site_of(record: StepRecord, storage: StorageRecord) -> str:
    """Where a storage was made; made by a backward op: the forward line whose backward it is."""
    ops = record.ops
    created = storage.created
    if 0 <= created < len(ops) and ops[created].phase == "backward":
        forward = ops[created].forward_op
        if forward >= 0 and record.sites[ops[forward].site]:
            return f"{record.sites[ops[forward].site]} (backward)"
    return record.sites[storage.site]


def build_plan(record: StepRecord) -> MemoryPlan:
    """The :class:`MemoryPlan` of a recorded step."""
    ops = record.ops
    n_ops = len(ops)
    phases = [op.phase for op in ops]
    spans = backward_spans(phases)
    sites = record.sites
    calls = record.calls
    device = plan_device(record.storages)

    def block_of(call: int) -> str:
        return calls[call].path if call >= 0 else ""

    lifetimes = [
        Lifetime(
            index=i,
            category=categorize(s, phases, spans),
            nbytes=s.nbytes,
            created=s.created,
            last_use=s.last_use,
            freed=s.freed,
            site=_site_of(record, s),
            shape=s.shape,
            dtype=s.dtype,
            device=s.device,
            name=s.name,
            block=block_of(s.call),
            saved_by=tuple(dict.fromkeys(block_of(c) for c in s.saved_by)),
            owner=s.owner,
            last_forward_use=s.last_forward_use,
            first_backward_use=s.first_backward_use,
            last_backward_use=s.last_backward_use,
        )
        for i, s in enumerate(record.storages)
    ]
    rank = {category: k for k, category in enumerate(CATEGORIES)}
    intervals = [
        (
            max(life.created, 0),
            n_ops if life.freed is None else life.freed,
            life.nbytes,
            rank[life.category],
        )
        for life in lifetimes
        if life.device == device
    ]
    rows = sweep(intervals, n_ops, len(CATEGORIES))
    totals = [sum(row) for row in rows]
    peak = max(range(n_ops), key=lambda op: (totals[op], -op)) if n_ops else 0
    shown = categories_of(life.category for life in lifetimes)
    at = [rank[c] for c in shown]
    timeline = [
        (op, ops[op].start_s, {c: rows[op][k] for c, k in zip(shown, at, strict=True)})
        for op in range(n_ops)
    ]
    infos = []
    for op in ops:
        site = sites[op.site]
        if op.phase == "backward" and op.forward_op >= 0:
            site = sites[ops[op.forward_op].site] or site
        call = op.call
        if call < 0 and op.forward_op >= 0:
            call = ops[op.forward_op].call
        infos.append(OpInfo(op.name, op.start_s, site, block_of(call), op.phase))
    at_peak = dict(timeline[peak][2]) if n_ops else dict.fromkeys(shown, 0)
    return MemoryPlan(
        peak_bytes=totals[peak] if n_ops else 0,
        peak_op=peak,
        peak_site=infos[peak].site if n_ops else "",
        peak_phase=infos[peak].phase if n_ops else "",
        at_peak=at_peak,
        at_peak_by_tier=_at_peak_by_tier(record, lifetimes, device, peak, n_ops),
        timeline=timeline,
        lifetimes=lifetimes,
        ops=infos,
        calls=_block_calls(record, lifetimes, record.seconds),
        optimizer_steps=list(record.optimizer_steps),
        gradient_readers=list(record.gradient_readers),
        device=device,
        seconds=record.seconds,
        module_ids=dict(record.module_ids),
    )
