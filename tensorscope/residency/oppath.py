"""The op path: what the interceptor runs around every op that touches managed tensors.

Before the op: its managed operands are pinned (no thread may demote them while it runs), made
resident (room made by demoting what the policy chooses; a truncated offload file raises here,
before anything touches its mapping), and the bytes of the results it will create are reserved.
After the op: the results are registered when they are to be managed, and the policy's
demotions and prefetches are applied. A multi-tensor op too large for the budget runs in groups
that fit (``split.py``).

The op path talks to the manager through the public methods it declares in ``OpPathManager``
(manager.py's NOTE [the op path's interface]): it holds the manager's lock for the op's
preparation and its accounting and lets it go while the op computes, pins through
``manager.pinned`` (never counting pins itself), and counts each op through the manager's tally
(tally.py), the same count the C++ fast path's log is replayed by.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tensorscope._adopt import accumulate_grad_leaf
from tensorscope._optable import (
    GRAD_CANDIDATE,
    MUTATING,
    OVERWRITES,
    SETS_STORAGE,
    TABLE,
    OpInfo,
    op_info,
)
from tensorscope._torch import no_dispatch, storage_address
from tensorscope._units import format_bytes
from tensorscope.errors import OutOfBudgetError
from tensorscope.graph.order import ModuleOrder
from tensorscope.graph.record import Recorder
from tensorscope.policies import Action, OpView, Policy
from tensorscope.residency import room, split, watch
from tensorscope.residency.cadence import Cadence
from tensorscope.residency.estimate import Estimates, call, result_sizes, tensors, to_meta
from tensorscope.residency.ledger import Ledger
from tensorscope.residency.movers import Movers, lost_error
from tensorscope.residency.pace import Pace
from tensorscope.residency.pins import Pins, Unlocked
from tensorscope.residency.placement import Placement
from tensorscope.residency.room import Blocked
from tensorscope.residency.tally import Tally
from tensorscope.residency.tiers import TierName

__all__ = ["OpPath", "OpPathManager"]

_CAT = torch.ops.aten.cat.default


class OpPathManager(Protocol):
    """What the op path asks of the manager (``ResidencyManager`` provides it)."""

    ledger: Ledger
    cadence: Cadence
    pace: Pace
    order: ModuleOrder
    tally: Tally

    @property
    def lock(self) -> threading.RLock: ...
    @property
    def budget_bytes(self) -> int | None: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def tiers(self) -> tuple[TierName, ...]: ...

    def pinned(self, placements: Sequence[Placement], wake: bool = True) -> Pins: ...
    def unlocked(self) -> Unlocked: ...
    def room_freed(self) -> None: ...
    def sync_ops(self) -> None: ...
    def begin_op(self, reserved: int) -> None: ...
    def end_op(self, reserved: int) -> None: ...
    def recorder(self) -> Recorder: ...
    def check_fits(self, nbytes: int, what: str) -> None: ...
    def make_room(self, needed: int, what: str, *, holding_pins: bool = False) -> None: ...
    def movers(self) -> Movers: ...
    def promote_placement(self, placement: Placement, checked: bool = False) -> None: ...
    def replace_lost(self, placement: Placement) -> None: ...
    def relocate(self, placement: Placement) -> None: ...
    def add(self, placement: Placement) -> None: ...
    def landed_late(self) -> None: ...
    def apply(self, actions: list[Action]) -> None: ...


def _overwritten(info: OpInfo, args: tuple[Any, ...]) -> int | None:
    """The storage an op overwrites whole without reading it (``copy_`` into a whole tensor,
    ``fill_``...): its bytes may be lost (``Movers.replace_lost``). None for any other op."""
    if not info.flags & OVERWRITES or not args or not isinstance(args[0], torch.Tensor):
        return None
    dest = args[0]
    if dest.layout is not torch.strided or dest.device.type == "meta":
        return None
    whole = dest.numel() * dest.element_size() == dest.untyped_storage().nbytes()
    if not whole or dest.storage_offset() != 0 or not dest.is_contiguous():
        return None
    return storage_address(dest)


class OpPath:
    """Runs ops on managed tensors for the manager (see the module docstring)."""

    def __init__(self, manager: OpPathManager) -> None:
        self.manager = manager
        self.estimates = Estimates()  # result sizes per op signature

    def clear_cache(self) -> None:
        self.estimates.clear()

    def operands(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[Placement]:
        """The distinct placements of the managed tensors among an op's arguments."""
        found: list[Placement] = []
        placements = self.manager.ledger.placements
        for source in (args, kwargs.values()) if kwargs else (args,):
            for tensor in tensors(source):
                if tensor.layout is not torch.strided or tensor.device.type == "meta":
                    continue
                placement = placements.get(storage_address(tensor))
                if placement is not None and placement not in found:
                    found.append(placement)
        return found

    # ----------------------------------------------------------------------------- the op
    def run(
        self,
        func: Any,
        kind: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        results_due: bool,
    ) -> Any:
        operands = self.operands(args, kwargs)
        if not operands and (kind != GRAD_CANDIDATE or not self._grad_of_managed()):
            return call(func, args, kwargs)
        manager = self.manager
        info = TABLE.get(id(func)) or op_info(func)
        group = 0
        manage_results = False
        if kind != MUTATING:
            leaf = accumulate_grad_leaf() if kind == GRAD_CANDIDATE else None
            if leaf is not None:  # a .grad in the making: managed with its parameter's group
                leaf_placement = manager.ledger.find(leaf)
                manage_results = leaf_placement is not None
                group = leaf_placement.uid if leaf_placement is not None else 0
            else:
                manage_results = results_due
        estimate, slack, signature = (
            self.estimates.estimate(func, args, kwargs or {}) if manage_results else (0, 0, None)
        )
        budget = manager.budget_bytes
        if budget is not None and sum(p.nbytes for p in operands) + estimate > budget:
            if func is _CAT and not manage_results:
                return self._cat_in_pieces(func, kind, args, kwargs or {}, budget)
            calls = self._split(func, args, kwargs or {}, budget, manage_results)
            if calls is not None:
                return split.join_results(
                    [self.run(func, kind, a, k, results_due) for a, k in calls]
                )
        mutating = kind == MUTATING
        overwritten = _overwritten(info, args) if mutating else None
        replacing = watch.before_data_change(args[0]) if info.flags & SETS_STORAGE else None
        tally = manager.tally
        with manager.lock:
            estimate, moved = self._prepare(info, operands, estimate, slack)
            with manager.pinned(operands) as pins:
                while not self._make_resident(operands, estimate, mutating, info, overwritten):
                    pins.wait_for_room()  # other threads' ops hold the room: wait for one
                manager.begin_op(estimate)  # its results' bytes reserved
                roles = tuple(p.role for p in operands)
                tally.record(manager.recorder(), manager.order, func, roles, manager.pace.clock())
                try:
                    with manager.unlocked():  # the op computes, its operands pinned
                        if any(placement.pending is not None for placement in operands):
                            self._wait_for_prefetches(operands)
                        out = call(func, args, kwargs)
                except BaseException:
                    manager.end_op(estimate)
                    raise  # unpinned as the block ends
                manager.end_op(estimate)
                tally.used(operands)
                if mutating:
                    for placement in operands:
                        placement.written = True
                results: list[Placement] = []
                if manage_results:
                    results, made = self._register_results(out, operands, group)
                    self.estimates.learn(signature, made)
            # the op is done with its operands: unpinned, waiting threads woken
            self._decide(info, operands, results, moved)
        if replacing is not None:  # parametrize's original.set_(new): see watch.py
            watch.data_replaced(args[0], replacing)
        return out

    def _prepare(
        self, info: OpInfo, operands: list[Placement], estimate: int, slack: int
    ) -> tuple[int, bool]:
        """Count the op and check that it can fit (the lock held); returns the bytes to reserve
        for its results, and whether an operand was off the device (the policy then decides
        after the op: cadence.py)."""
        manager = self.manager
        moved = any(p.tier != "device" for p in operands)
        manager.sync_ops()  # first the ops the C++ op path ran (native.py)
        manager.tally.tick()
        need = sum(p.nbytes for p in operands) + estimate - slack
        manager.check_fits(need, f"op {info.label} (operands and results)")
        budget = manager.budget_bytes
        if budget is not None:  # never refuse an op for the slack alone
            estimate -= slack - max(0, min(slack, budget - need))
        return estimate, moved

    def _make_resident(
        self,
        operands: list[Placement],
        estimate: int,
        mutating: bool,
        info: OpInfo,
        overwritten: int | None = None,
    ) -> bool:
        """Make the (pinned) operands resident, with room for the results; False when only
        other threads' ops in flight can free the room."""
        manager = self.manager
        try:
            movers = manager.movers()
            renewed: list[Placement] = []
            for placement, reason in movers.lost(operands):
                if placement.key != overwritten:
                    raise lost_error(placement, reason)
                renewed.append(placement)  # lost, but the op overwrites all of it
            missing = [p for p in operands if p.tier != "device" or p in renewed]
            needed = sum(p.nbytes for p in missing if p.tier != "device") + estimate
            manager.make_room(needed, f"op {info.label}", holding_pins=True)
            for placement in missing:
                if placement in renewed:
                    manager.replace_lost(placement)
                else:
                    manager.promote_placement(placement, checked=True)
            if mutating:  # copy on first write: a checkpoint file is never modified
                for placement in operands:
                    if placement.region is not None and placement.region.readonly:
                        manager.relocate(placement)
        except Blocked:
            return False
        return True

    def _wait_for_prefetches(self, operands: list[Placement]) -> None:
        started = time.perf_counter()
        for placement in operands:
            placement.wait()
        self.manager.pace.stalled(time.perf_counter() - started)

    def _decide(
        self, info: OpInfo, operands: list[Placement], results: list[Placement], moved: bool
    ) -> None:
        """After the op (the lock held): room for results the estimate missed, and the
        policy's demotions and prefetches, at the ops where it decides (cadence.py)."""
        manager = self.manager
        ledger = manager.ledger
        clock = manager.tally.clock
        budget = manager.budget_bytes
        if budget is not None and ledger.device_total > budget:
            manager.make_room(0, f"op {info.label} (results)")  # the estimate was short
        manager.landed_late()  # placements the fast path may take again
        policy = manager.policy
        recorder = manager.recorder()
        cadence = manager.cadence
        horizon = None
        busy = (*operands, *results)
        key = None
        if budget is not None and cadence.coarse(policy, budget, recorder):
            if not results and cadence.skips(clock, moved):
                cadence.passed(clock)
                return
            horizon = cadence.decided(recorder, ledger, budget, clock)
            busy_uids = tuple(p.uid for p in busy)
            key = cadence.key(recorder.position, ledger, busy_uids, manager.pace.read_rate)
            remembered = cadence.recall(key)
            if remembered is not None:
                manager.apply(remembered)
                manager.room_freed()
                return
        elif cadence.decide_at:
            cadence.every_op()
        snapshot = None
        # the policy sees them as in use while it decides (waiters are woken after apply)
        with manager.pinned(busy, wake=False):
            if getattr(policy, "wants_snapshot_after_op", True):
                snapshot = room.snapshot(
                    ledger,
                    recorder,
                    budget,
                    clock,
                    True,
                    manager.pace.read_rate,
                    manager.order,
                    horizon,
                )
            view = OpView(
                info.label,
                tuple(p.uid for p in operands),
                tuple(p.uid for p in results),
                snapshot,
            )
            actions = policy.after_op(view)
        if key is not None and snapshot is not None:
            cadence.remember(key, actions, snapshot)
        manager.apply(actions)
        manager.room_freed()

    def _register_results(
        self, out: Any, operands: list[Placement], group: int
    ) -> tuple[list[Placement], int]:
        """The placements of ``out`` (new ones registered) and the bytes of the new ones."""
        manager = self.manager
        made = 0
        ledger = manager.ledger
        # Results belong with the parameter their first operand belongs to (a grad or
        # optimizer state goes away with its parameter on remove()).
        if not group and operands:
            group = operands[0].group or operands[0].uid
        position = manager.recorder().position
        results: list[Placement] = []
        for index, tensor in enumerate(tensors(out if isinstance(out, (list, tuple)) else (out,))):
            if tensor.layout is not torch.strided or tensor.numel() == 0:
                continue
            found = ledger.placements.get(storage_address(tensor))
            if found is None:
                placement = Placement(tensor.untyped_storage(), ("new", position, index), group)
                placement.last_use = manager.tally.clock
                self._fit(placement)
                manager.add(placement)
                made += placement.nbytes
            else:
                placement = found
                if placement.group != group and placement not in operands:
                    placement.group = group  # e.g. an activation's storage became a .grad
            if placement not in results:
                results.append(placement)
        return results, made

    def _fit(self, placement: Placement) -> None:
        """Room for a result the estimate did not cover (a ``.grad`` stolen from an unmanaged
        gradient is an alias: no fresh bytes): demote others, or else it starts on the tier
        below (as ``ts.manage()`` does with a tensor larger than the budget)."""
        manager = self.manager
        budget = manager.budget_bytes
        if budget is None or manager.ledger.device_total + placement.nbytes <= budget:
            return
        with contextlib.suppress(Blocked, OutOfBudgetError):
            manager.make_room(placement.nbytes, "a result", holding_pins=True)
        if manager.ledger.device_total + placement.nbytes > budget:
            manager.movers().demote(placement, manager.tiers[1])

    # -------------------------------------------------------------------------- estimates
    def _grad_of_managed(self) -> bool:
        """Whether autograd is making the ``.grad`` of a managed tensor right now: the
        gradient is managed even when what it is made from is not (a plain input's backward,
        DDP's bucket)."""
        leaf = accumulate_grad_leaf()
        return leaf is not None and self.manager.ledger.find(leaf) is not None

    def _cat_in_pieces(
        self,
        func: Any,
        kind: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        budget: int,
    ) -> torch.Tensor:
        """``torch.cat`` of managed tensors larger than the budget, into an unmanaged result
        (see split.py's NOTE on flattening for communication)."""
        parts, dim = split.cat_arguments(args, kwargs)
        placements = self.manager.ledger.placements
        sizes = []
        for tensor in parts:
            placement = placements.get(storage_address(tensor))
            sizes.append(placement.nbytes if placement is not None else 0)
            self.manager.check_fits(sizes[-1], f"op {func} (one of its tensors)")
        with no_dispatch():
            meta = call(func, to_meta((parts, dim)), None)

        def run(group: list[torch.Tensor]) -> torch.Tensor:
            return self.run(func, kind, (group, dim), None, False)  # type: ignore[no-any-return]

        return split.cat_in_pieces(parts, dim, sizes, budget, meta, run)

    def _split(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        budget: int,
        manage_results: bool,
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | None:
        """Calls of a multi-tensor op on index groups that fit the budget (None: not one)."""
        if not split.is_multi_tensor(func):
            return None
        sizes = result_sizes(func, args, kwargs) if manage_results else None
        listed: set[int] = set()

        def index_bytes(index: int) -> int:
            total = sizes[index] if sizes is not None and index < len(sizes) else 0
            one_index = split.slice_call(func, args, kwargs, range(index, index + 1))
            for placement in self.operands(*one_index):
                listed.add(placement.key)
                total += placement.nbytes
            return total

        per_index = [index_bytes(i) for i in range(split.index_count(func, args, kwargs))]
        fixed = sum(p.nbytes for p in self.operands(args, kwargs) if p.key not in listed)
        largest = fixed + max(per_index, default=0)
        if per_index and largest > budget:
            raise OutOfBudgetError(
                f"tensorscope.residency: op {func} is split into groups that fit the budget, "
                f"but one index alone (a tensor with its gradient, state and result) needs "
                f"{format_bytes(largest)}, more than the budget of {format_bytes(budget)}. "
                "Nothing was moved. Raise the budget (ts.residency.configure(budget=...)) to at "
                f"least {format_bytes(largest)}."
            )
        chunks = split.plan_chunks(func, args, kwargs, lambda i: per_index[i], fixed, budget)
        if chunks is None or len(chunks) < 2:
            return None
        return [split.slice_call(func, args, kwargs, chunk) for chunk in chunks]
