"""The residency manager (the seed's tensorsManager): a byte budget on the device tier.

``ts.residency`` is the process-wide manager. Before every op on managed tensors it makes the
operands resident on the device, asking the policy what to demote to make room, and after the op
it applies the policy's demotions and prefetches (``oppath.py``). See docs/api.md §4 and
docs/residency.md.

# NOTE [what is managed]
# Parameters and buffers given to ``ts.manage``; tensors explicitly demoted; and new storages made
# by ops on managed tensors when (a) a scope is open (activations and temporaries), (b) an
# optimizer step runs (its state), or (c) autograd accumulates a managed parameter's ``.grad``.
# Outside scopes, results of ops on managed tensors are plain temporaries, not managed.
#
# NOTE [threads]
# One lock protects the ledger, the policy, the recorders and the tiers. An op holds it only
# while its operands are made resident and while its results are registered, not while it
# computes (``unlocked()``): meanwhile its operands are *pinned* (``pinned()``, pins.py), so no
# other thread demotes them, and the bytes of its results are *reserved* in the ledger
# (``begin_op``), so two threads' ops together never pass the budget. A thread that cannot make
# room because other threads' ops pin the bytes waits for one of them to finish
# (``Pins.wait_for_room``); with no op in flight elsewhere it raises ``OutOfBudgetError``. Each
# thread records its own trace for Flow's predictions.
#
# NOTE [the op path's interface]
# oppath.py runs each op through the public methods under "the op path's side" below (the
# ``OpPathManager`` protocol there lists them), never the manager's private state:
# tests/residency/test_oppath_interface.py checks it.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from tensorscope import _intercept
from tensorscope._slot import set_residency_active
from tensorscope._thread import ThreadState, thread_state
from tensorscope._torch import storage_address
from tensorscope._units import format_bytes
from tensorscope.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    OutOfBudgetError,
    ResidencyError,
)
from tensorscope.graph.order import ModuleOrder
from tensorscope.graph.record import Recorder
from tensorscope.policies import Action, Flow, Policy
from tensorscope.residency import backends, config, native, room, watch
from tensorscope.residency.backends import Backend
from tensorscope.residency.cadence import Cadence
from tensorscope.residency.disk import DiskTier
from tensorscope.residency.ledger import Ledger
from tensorscope.residency.modules import ModuleSupport
from tensorscope.residency.movers import Movers
from tensorscope.residency.oppath import OpPath
from tensorscope.residency.pace import Pace
from tensorscope.residency.pins import Pins, Unlocked
from tensorscope.residency.placement import Placement
from tensorscope.residency.prefetch import Prefetcher
from tensorscope.residency.report import ResidencyReport, TierReport, Transfers
from tensorscope.residency.room import Blocked
from tensorscope.residency.signals import watch_private_dirs
from tensorscope.residency.tally import Tally
from tensorscope.residency.tiers import TIER_ORDER, TierName

__all__ = ["ResidencyManager"]

_UNSET: Any = object()
_WAIT_S = 0.05  # re-check for room this often while other threads' ops hold it


class ResidencyManager(ModuleSupport):
    """Budget, tiers and policy for managed tensors. Use the singleton ``ts.residency``.

    Example:
        >>> import torch, tensorscope as ts
        >>> ts.residency.configure(device="cpu", policy="genoa", budget="64MiB")
        >>> t = ts.ref(torch.ones(1024))
        >>> t.demote().tier
        'disk'
        >>> (t + 1).sum().item(), t.tier
        (2048.0, 'disk')
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)  # notified when an op unpins
        self._unlocked = Unlocked(self._lock)
        self._device = backends.default_device()
        self._backend: Backend | None = None  # what differs per device (made on first use)
        self._policy: Policy = Flow()
        self._budget: int | None = None
        self._offload_dir: str | None = None
        self._disk: DiskTier | None = None
        self._movers: Movers | None = None
        self._prefetcher: Prefetcher | None = None
        # Prefetches that landed while the lock was held (appended by the prefetch threads).
        self._landed_late: collections.deque[tuple[Placement, threading.Event]] = (
            collections.deque()
        )
        self.pace = Pace()  # measured read rate and compute clock (Flow's prefetch depth)
        self.ledger = Ledger()
        self._recorders: dict[int, Recorder] = {}
        self.order = ModuleOrder()  # next uses guessed before an iteration is recorded
        # How ops are counted (tally.py): the op path counts each op through it (tick,
        # record, used), sync_ops replays the fast path's log into it.
        self.tally = Tally(self.sweep, self.iteration_end)
        self.in_flight = 0  # ops between begin_op() and end_op(), on all threads
        self._threads: dict[int, ThreadState] = {}  # threads whose mode routes ops here
        self._handles: weakref.WeakSet[Any] = weakref.WeakSet()  # live ts.manage() handles
        self.ops = OpPath(self)
        self.cadence = Cadence()  # after which ops the policy decides (cadence.py)
        self.converted = 0  # stored tensors converted into offload files (another dtype)
        native.setup(self.sync_ops)
        native.set_policy(self._policy)

    # ------------------------------------------------------------------------ configuration
    def configure(
        self,
        device: str | torch.device = _UNSET,
        policy: str | Policy = _UNSET,
        budget: int | str | None = _UNSET,
        offload_dir: str | os.PathLike[str] | None = _UNSET,
    ) -> None:
        """Set the device, policy, budget and offload directory (omitted ones are unchanged).

        Args:
            device: "cuda", "cpu" or a ``torch.device``; default CUDA when available.
            policy: "flow" (default), "genoa", ``ts.Flow()``, ``ts.Genoa()`` or your own.
            budget: hard limit on managed bytes on the device: bytes, or "6GiB", "300MiB",
                "1.5GB"; ``None`` for no limit. A smaller budget demotes the excess at once.
            offload_dir: directory for the disk tier; ``None`` for a private temporary one.

        Raises:
            InvalidArgumentError: (a ValueError) unparsable, zero or negative budget, unknown
                policy or device, an empty offload_dir.
            ArgumentTypeError: (a TypeError) a value of the wrong type (a policy class).
            ResidencyError: an unwritable or unsafe ``offload_dir``, or one changed while data
                is on disk; a new device while tensors are managed.
        """
        config.check_storage_door()
        new_budget = self._budget if budget is _UNSET else config.parse_budget(budget)
        new_policy = self._policy if policy is _UNSET else config.parse_policy(policy)
        new_device = self._device if device is _UNSET else config.parse_device(device)
        new_dir: Any = _UNSET if offload_dir is _UNSET else config.check_offload_dir(offload_dir)
        new_backend = backends.backend_for(new_device)  # reads TENSORSCOPE_BACKEND
        with self._lock:
            if new_backend is not self.backend and self.ledger.placements:
                raise ResidencyError(
                    f"tensorscope.residency: cannot move {len(self.ledger)} managed tensors "
                    f"from {self._device} ({self.backend.name} backend) to {new_device} "
                    f"({new_backend.name} backend); remove() them first."
                )
            if new_dir is not _UNSET:
                self._set_offload_dir(new_dir)  # a checked str or None
            if new_backend is not self._backend:
                self._movers = None
            self._device = new_device
            self._backend = new_backend
            self.sync_ops()
            if new_policy is not self._policy:
                self._policy = new_policy
                self._recorders.clear()
                native.set_policy(new_policy)
            self._budget = new_budget
            self.cadence.every_op()  # until the next decision, with the new policy and budget
            self.ledger.reset_peaks()
            if new_budget is not None and self.ledger.device_total > new_budget:
                self.make_room(0, "configure(budget=...)")

    def _set_offload_dir(self, wanted: str | None) -> None:
        if wanted == self._offload_dir and self._disk is not None:
            return
        if any(p.region is not None for p in self.ledger.placements.values()):
            raise ResidencyError(
                "tensorscope.residency: cannot change offload_dir while managed tensors live in "
                "its files; remove() them (handle.remove(), or let them die) first."
            )
        disk = self._new_disk(wanted)  # raises ResidencyError if unusable
        if self._disk is not None:
            self._disk.close()
        self._disk = disk
        self._offload_dir = wanted

    @staticmethod
    def _new_disk(directory: str | None) -> DiskTier:
        disk = DiskTier(directory)
        if disk.private:
            watch_private_dirs()
        return disk

    @property
    def device(self) -> torch.device:
        """The compute device (assignable: ``ts.residency.device = "cuda"``)."""
        return self._device

    @device.setter
    def device(self, value: str | torch.device) -> None:
        self.configure(device=value)

    @property
    def budget_bytes(self) -> int | None:
        return self._budget

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def backend(self) -> Backend:
        """What differs per device (``residency/backends``), chosen when configured."""
        backend = self._backend
        if backend is None:
            backend = self._backend = backends.backend_for(self._device)
        return backend

    @property
    def tiers(self) -> tuple[TierName, ...]:
        """The tiers in use, top to bottom (no host tier when the device is the CPU)."""
        return self.backend.tiers

    @property
    def disk(self) -> DiskTier:
        """The disk tier (made on first use)."""
        if self._disk is None:
            self._disk = self._new_disk(self._offload_dir)
        return self._disk

    def movers(self) -> Movers:
        disk = self.disk
        if self._movers is None or self._movers.disk is not disk:
            self._movers = Movers(self.backend, disk)
        return self._movers

    def recorder(self) -> Recorder:
        """This thread's trace recorder (each thread predicts from its own iterations)."""
        ident = threading.get_ident()
        recorder = self._recorders.get(ident)
        if recorder is None:
            recorder = self._recorders[ident] = Recorder()
        return recorder

    # ------------------------------------------------------------------------------- report
    def report(self, reset: bool = False) -> ResidencyReport:
        """Resident and peak bytes per tier, transfers, prefetches. ``reset`` restarts peaks."""
        with self._lock:
            self.sync_ops()
            self.sweep()
            ledger = self.ledger
            counts: dict[str, int] = dict.fromkeys(self.tiers, 0)
            for placement in ledger.placements.values():
                counts[placement.tier] = counts.get(placement.tier, 0) + 1
            tiers: dict[str, TierReport] = {
                name: TierReport(ledger.bytes[name], ledger.peak[name], counts.get(name, 0))
                for name in self.tiers
            }
            count, nbytes, seconds = ledger.transfers
            in_checkpoint = [
                p for p in ledger.placements.values() if p.region is not None and p.region.readonly
            ]
            pinned, limit, pageable, why = self.backend.staging_report()
            rep = ResidencyReport(
                str(self._device),
                getattr(self._policy, "name", type(self._policy).__name__),
                self._budget,
                tiers,
                Transfers(int(count), int(nbytes), float(seconds)),
                ledger.prefetched,
                len(in_checkpoint),
                sum(p.nbytes for p in in_checkpoint),
                self.converted,
                self.pace.read_rate,
                *self._allocator_bytes(),
                pinned,
                limit,
                pageable,
                why,
            )
            if reset:
                ledger.reset_counters()
            return rep

    # ------------------------------------------------------------------------ registration
    def _allocator_bytes(self) -> tuple[int | None, int | None]:
        """(reserved, allocated) of the device's caching allocator (CUDA); Nones elsewhere."""
        return self.backend.allocator_bytes()

    def placement_of(self, tensor: torch.Tensor) -> Placement | None:
        """The placement managing ``tensor``'s storage, or None."""
        return self.ledger.find(tensor)

    def register(
        self, tensor: torch.Tensor, role: Hashable | None = None, group: int = 0
    ) -> Placement:
        """Manage ``tensor``'s storage (idempotent); it starts on the device tier."""
        with self._lock:
            existing = self.ledger.find(tensor)
            if existing is not None:
                return existing
            if tensor.layout is not torch.strided or tensor.device.type == "meta":
                raise ArgumentTypeError(
                    "tensorscope.residency: only dense (strided) tensors can be managed; got "
                    f"layout {tensor.layout} on {tensor.device}."
                )
            if tensor.device.type != self._device.type:
                raise ResidencyError(
                    f"tensorscope.residency: this tensor is on {tensor.device} but the device "
                    f"tier is {self._device}; move it first (.to({str(self._device)!r}))."
                )
            placement = Placement(tensor.untyped_storage(), role, group)
            self.add(placement)
            self.attach_thread()
            return placement

    def add(self, placement: Placement) -> None:
        if not self.ledger.placements:
            set_residency_active(self, True)
        self.ledger.add(placement)

    def attach_thread(self) -> None:
        """Route this thread's ops through the manager (until nothing is managed)."""
        state = thread_state()
        if state.thread_id not in self._threads:
            _intercept.acquire(state, residency=True)
            self._threads[state.thread_id] = state

    def _detach_threads(self) -> None:
        for state in list(self._threads.values()):
            _intercept.release(state, residency=True)
        self._threads.clear()
        set_residency_active(self, False)

    def unregister(self, placement: Placement, lost: str = "keep") -> str | None:
        """Stop managing: the bytes go back to ordinary device memory. A placement whose bytes
        are lost stays managed (every use raises ``ResidencyError``) and why is returned;
        ``lost="poison"`` lets it go all the same, filled with NaN (see ``Movers.materialize``)."""
        with self._lock:
            if self.ledger.placements.get(placement.key) is not placement:
                return None
            placement.wait()
            while not native.claim(placement):
                self._room.wait(_WAIT_S)  # a fast op on another thread uses it
            source = placement.tier
            try:
                reason = self.movers().materialize(placement, lost)
            except BaseException:
                native.publish(placement)
                raise
            if reason is not None and lost == "keep":
                native.publish(placement)
                return reason
            # It leaves the accounting from the tier it was on: ordinary memory is not managed.
            self._forget(placement, tier=source)
            return reason

    def _forget(self, placement: Placement, tier: TierName | None = None) -> None:
        placement.wait()
        for ref, original in placement.restore:  # a ts.manage()d tensor gets its class back
            tensor = ref()
            # ...unless it holds another managed storage now (its data was replaced: .half(),
            # .data = ..., set_()): that placement gives the class back when it goes.
            if tensor is not None and (
                storage_address(tensor) == placement.key or self.ledger.find(tensor) is None
            ):
                tensor.__class__ = original
        placement.restore = []
        region = self.ledger.forget(placement, tier)
        if region is not None and self._disk is not None:
            # Nothing uses its memory any more (the storage died, or has other memory now).
            self._disk.release(region, reusable=True)
        if not self.ledger.placements:
            self.order.clear()
            if self._threads:
                self._detach_threads()

    def sweep(self, keys: Iterable[int] | None = None) -> None:
        """Forget placements whose storage nothing but the placement still holds."""
        self.tally.swept()
        placements = self.ledger.placements
        candidates = (
            list(placements.values())
            if keys is None
            else [p for k in keys if (p := placements.get(k)) is not None]
        )
        for placement in candidates:
            if not placement.pins and not placement.alive_elsewhere():
                self._forget(placement)

    # ----------------------------------------------------------------- public moves (hooks)
    def demote(self, tensor: torch.Tensor, tier: str | None = None) -> None:
        """Move ``tensor``'s data down to ``tier`` (default: the next tier below its own)."""
        with self._lock:
            target = None if tier is None else self._check_tier(tier)
            placement = self.register(tensor)
            while not self.demote_placement(placement, target):
                self._room.wait(_WAIT_S)  # a fast op on another thread uses it

    def promote(self, tensor: torch.Tensor) -> None:
        """Bring ``tensor``'s data to the device tier, making room under the budget."""
        with self._lock:
            placement = self.ledger.find(tensor)
            if placement is None or placement.tier == "device":
                return
            self.check_fits(placement.nbytes, "promote()")
            with self.pinned([placement]) as pins:
                while True:
                    try:
                        self.make_room(placement.nbytes, "promote()", holding_pins=True)
                        self.promote_placement(placement)
                        return
                    except Blocked:
                        pins.wait_for_room()  # room only other threads' ops can free

    def tier_of(self, tensor: torch.Tensor) -> TierName:
        placement = self.ledger.find(tensor)
        if placement is not None:
            return placement.tier
        return "device" if tensor.device.type == self._device.type else "host"

    def storages_disposed(self, keys: list[int]) -> None:
        """Refs of these storages were disposed: forget placements nothing else holds."""
        if not self.ledger.placements:
            return
        with self._lock:
            self.sweep(keys if keys else None)

    def run_op(
        self,
        func: Any,
        kind: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        results_due: bool,
    ) -> Any:
        """Run ``func`` with its managed operands resident (see oppath.py)."""
        return self.ops.run(func, kind, args, kwargs, results_due)

    def sync_ops(self) -> None:
        """Count the ops this thread's C++ op path ran since the last call into the ledger and
        the recorder, as the Python op path counts an op (tally.py, native.py)."""
        engine = native.ENGINE
        if engine is None:
            return
        drained = engine.res_drain()
        if drained is None:
            return
        with self._lock:
            stalled = self.pace.clock_at(0.0)
            self.tally.replay(self.recorder(), self.order, self.ledger.by_uid, drained, stalled)

    # ---------------------------------------------------------------- the op path's side
    # NOTE [the op path's interface]: what oppath.py uses, besides the ledger, the policy,
    # the cadence, the pace, the module order, the tally and the moves above.
    @property
    def lock(self) -> threading.RLock:
        """The manager's one lock (NOTE [threads]); re-entrant."""
        return self._lock

    @property
    def clock(self) -> int:
        """Ops counted on managed tensors so far (all threads; tally.py)."""
        return self.tally.clock

    def pinned(self, placements: Sequence[Placement], wake: bool = True) -> Pins:
        """``with manager.pinned(placements) as pins:`` keeps them on the device (pins.py);
        ``wake=False``: threads waiting for room are not woken when they are unpinned."""
        return Pins(placements, self._lock, self._room, _WAIT_S, wake)

    def unlocked(self) -> Unlocked:
        """``with manager.unlocked():`` (the lock held) lets it go while an op computes."""
        return self._unlocked

    def room_freed(self) -> None:
        """Wake the threads waiting for room (bytes were demoted or unpinned)."""
        self._room.notify_all()

    def begin_op(self, reserved: int) -> None:
        """An op is in flight, its results' bytes reserved against the budget."""
        self.ledger.reserved += reserved
        self.in_flight += 1

    def end_op(self, reserved: int) -> None:
        """The op ended (or failed): what ``begin_op`` reserved is given back."""
        self.ledger.reserved -= reserved
        self.in_flight -= 1

    def iteration_boundary(self) -> None:
        """End of an iteration (an optimizer step): the trace so far predicts the next one."""
        with self._lock:
            self.sync_ops()
            self.recorder().boundary()
            self.iteration_end()
        watch.audit()  # tensors a module gained that no hook saw (see watch.py)

    def iteration_end(self) -> None:
        self.order.restart()
        self.sweep()
        self.release_heap()

    # ------------------------------------------------------------------------------- moves
    def _check_tier(self, tier: object) -> TierName:
        if tier not in TIER_ORDER:
            raise InvalidArgumentError(
                f"tensorscope.residency: unknown tier {tier!r}; use 'device', 'host' or 'disk'."
            )
        if tier not in self.tiers:
            raise ResidencyError(
                f"tensorscope.residency: there is no {tier} tier when the device is "
                f"{self._device}; tiers here: {', '.join(self.tiers)}."
            )
        return tier  # type: ignore[return-value,unused-ignore]

    def _lower(self, tier: str) -> TierName:
        tiers = self.tiers
        index = tiers.index(tier)  # type: ignore[arg-type,unused-ignore]
        return tiers[min(index + 1, len(tiers) - 1)]

    def demote_placement(self, placement: Placement, target: TierName | None = None) -> bool:
        """Move ``placement`` down; False if a fast op on another thread uses it right now
        (it counts as pinned, see native.py)."""
        source = placement.tier
        target = target or self._lower(source)
        if TIER_ORDER.index(target) <= TIER_ORDER.index(source):
            return True
        if not native.claim(placement):
            return False
        try:
            seconds = self.movers().demote(placement, target)  # raises before changing anything
        except BaseException:
            native.publish(placement)  # still where it was: back on the fast path
            raise
        self.ledger.moved(placement, source, seconds)
        region = placement.region
        if (
            region is not None
            and region.readonly
            and self.backend.maps_files
            and self.disk.streams(self._budget or 0)
        ):
            region.uncache()  # see the NOTE in DiskTier.streams
        self.release_heap()
        return True

    def promote_placement(self, placement: Placement, checked: bool = False) -> None:
        if placement.tier == "device":
            return
        movers = self.movers()
        if not checked:
            movers.check_readable(placement)
        source = placement.tier
        seconds = movers.promote(placement)
        self.ledger.moved(placement, source, seconds)
        if source == "disk":  # the op waits for these bytes
            self.pace.stalled(seconds)
            self.pace.read(placement.nbytes, seconds)

    def prefetch(
        self,
        placement: Placement,
        batch: list[tuple[Placement, threading.Event]] | None = None,
        checked: bool = False,
    ) -> None:
        """Account a placement as resident now; its bytes arrive in the background (pages
        mapped by the prefetch thread on a CPU device, a copy stream on CUDA). ``batch``: a
        CPU prefetch is added there, for the caller to submit (``Prefetcher.submit_many``).
        ``checked``: the caller found its bytes readable (``Movers.lost``)."""
        movers = self.movers()
        if not checked and movers.damage(placement) is not None:
            return  # lost bytes: the op that needs them raises, a prefetch must not
        source = placement.tier
        if not movers.maps_files:  # a copy on the backend's copy stream
            try:
                seconds = movers.promote(placement, background=True)
            except ResidencyError:
                return  # the allocator is full now: the op that needs it promotes (or raises)
        elif placement.tier != "disk":
            self.promote_placement(placement)
            return
        else:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self.pace, self._landed)
            event = placement.pending = threading.Event()
            placement.tier = "device"
            if batch is None:
                self._prefetcher.submit(placement, event)
            else:
                batch.append((placement, event))
            seconds = 0.0
        self.ledger.moved(placement, source, seconds)
        self.ledger.prefetched += 1

    def _landed(self, placement: Placement, event: threading.Event) -> None:
        """A prefetch thread mapped ``placement``'s pages in: its ops need not wait (and may
        take the C++ fast path) from now on. Never waits for the lock: its holder may be
        waiting for a prefetch queued behind this one; the next op in Python publishes it."""
        if not self._lock.acquire(blocking=False):
            self._landed_late.append((placement, event))  # see landed_late()
            return
        try:
            self._land(placement, event)
        finally:
            self._lock.release()

    def landed_late(self) -> None:
        """Prefetches that landed while the lock was held (under the lock)."""
        late = self._landed_late
        while late:
            self._land(*late.popleft())

    @staticmethod
    def _land(placement: Placement, event: threading.Event) -> None:
        if placement.pending is event:
            placement.pending = None
            native.publish(placement, create=False)

    def check_fits(self, nbytes: int, what: str) -> None:
        if self._budget is not None and nbytes > self._budget:
            raise OutOfBudgetError(
                f"tensorscope.residency: {what} needs {format_bytes(nbytes)} on the device at "
                f"once, more than the whole budget of {format_bytes(self._budget)}. Nothing was "
                "moved. Raise the budget (ts.residency.configure(budget=...)) or split the op."
            )

    def make_room(self, needed: int, what: str, *, holding_pins: bool = False) -> None:
        """Demote until ``needed`` more bytes fit the budget (see the NOTE on threads).

        When only ops in flight on other threads can free the room, wait for them; a caller
        that holds pins gets ``Blocked`` instead: it must unpin, wait and start over (while it
        waits, its pins would block the others)."""
        budget = self._budget
        ledger = self.ledger
        self.sync_ops()
        while budget is not None and ledger.device_total + needed > budget:
            if self.tally.since_sweep > 8:
                self.sweep()  # placements nothing holds any more free room for nothing
            shortfall = ledger.device_total + needed - budget
            if shortfall <= 0:
                return
            for placement in room.victims(
                ledger, self._policy, self.recorder(), budget, self.clock, shortfall, self.order
            ):
                if placement.tier == "device" and not placement.pins:
                    self.demote_placement(placement)
                    if ledger.device_total + needed <= budget:
                        return
            if self.in_flight + native.in_flight() > 0:  # other threads' ops hold the bytes
                if holding_pins:
                    raise Blocked
                self._room.wait(_WAIT_S)
                continue
            raise OutOfBudgetError(
                f"tensorscope.residency: {what} needs {format_bytes(needed)} more on the device "
                f"but only {format_bytes(max(0, budget - ledger.device_total))} of the "
                f"{format_bytes(budget)} budget can be freed. Raise the budget."
            )

    def apply(self, actions: list[Action]) -> None:
        """Apply a policy's demotions and prefetches (prefetches only where they fit)."""
        budget = self._budget
        ledger = self.ledger
        # CPU prefetches go to the threads at once at the end (one wake-up, not one each).
        batch: list[tuple[Placement, threading.Event]] = []
        # Lost bytes are looked for once per file, not once per prefetch (a system call each):
        # a prefetch must not touch them, the op that needs them raises.
        wanted = [
            p
            for a in actions
            if a.kind == "prefetch" and (p := ledger.by_uid.get(a.key)) is not None
        ]
        lost = {id(p) for p, _ in self.movers().lost(wanted)} if wanted else set()
        try:
            for action in actions:
                placement = ledger.by_uid.get(action.key)
                if placement is None:
                    continue
                if action.kind == "demote":
                    if placement.tier == "device" and not placement.pins:
                        if any(p is placement for p, _ in batch):  # its demotion waits for it
                            self._submit(batch)
                        self.demote_placement(placement)
                elif action.kind == "prefetch" and placement.tier != "device":
                    if budget is not None and ledger.device_total + placement.nbytes > budget:
                        continue  # the policy's plan no longer fits: skip, the op will promote
                    if id(placement) not in lost:
                        self.prefetch(placement, batch, checked=True)
        finally:
            self._submit(batch)

    def _submit(self, batch: list[tuple[Placement, threading.Event]]) -> None:
        if batch and self._prefetcher is not None:
            self._prefetcher.submit_many(batch)
        batch.clear()

    # ------------------------------------------------------------------------------- misc
    def managed_count(self) -> int:
        return len(self.ledger)
