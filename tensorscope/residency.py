"""The residency manager (the seed's tensorsManager): a byte budget on the device tier.

``ts.residency`` is the process-wide manager. Before every op on managed tensors it makes the
operands resident on the device, asking the policy what to demote to make room, and after the op
it applies the policy's demotions and prefetches. See API.md §4 and docs/residency.md.

# NOTE [what is managed]
# Parameters and buffers given to ``ts.manage``; tensors explicitly demoted; and new storages made
# by ops on managed tensors when (a) a scope is open (activations and temporaries), (b) an
# optimizer step runs (its state), or (c) autograd accumulates a managed parameter's ``.grad``.
# Outside scopes, results of ops on managed tensors are plain temporaries, not managed.
#
# NOTE [the budget is a hard limit on accounted bytes]
# Before an op: operands, plus the results it will create when those are managed (their sizes
# come from running the op on meta tensors once per signature), must fit the budget, or the op
# raises OutOfBudgetError before anything moves. Room is made by demoting what the policy
# chooses. ``peak_bytes`` is the highest device-tier total ever accounted.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tensorscope._placement import Movers, Placement
from tensorscope._state import DISPOSAL_LISTENERS, STORAGE_HOLDERS
from tensorscope._torch import cuda_stream, storage_address
from tensorscope._units import format_bytes, parse_bytes
from tensorscope.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    OutOfBudgetError,
    ResidencyError,
)
from tensorscope.graph.record import Recorder
from tensorscope.policies import Action, Entry, Flow, Genoa, OpView, Policy, Snapshot
from tensorscope.tiers import (
    TIER_ORDER,
    DeviceTier,
    DiskTier,
    HostTier,
    TierName,
    release_free_heap,
)

if TYPE_CHECKING:
    from tensorscope._state import ThreadData

__all__ = ["ResidencyManager", "ResidencyReport", "TierReport", "Transfers", "residency"]

_UNSET: Any = object()
_SWEEP_EVERY = 64  # ops between sweeps of placements nothing else holds any more


@dataclass(frozen=True)
class TierReport:
    resident_bytes: int
    peak_bytes: int
    placements: int


@dataclass(frozen=True)
class Transfers:
    count: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ResidencyReport:
    """What ``ts.residency.report()`` returns; ``str()`` is a readable table."""

    device: str
    policy: str
    budget_bytes: int | None
    tiers: dict[str, TierReport]
    transfers: Transfers
    prefetches: int

    @property
    def peak_bytes(self) -> int:
        """Peak of the device tier (the budgeted one)."""
        return self.tiers["device"].peak_bytes

    def __str__(self) -> str:
        budget = "unlimited" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        lines = [
            f"tensorscope residency: device {self.device}, policy {self.policy}, budget {budget}",
            f"  {'tier':<8}{'resident':>12}{'peak':>12}{'tensors':>9}",
        ]
        for name, tier in self.tiers.items():
            lines.append(
                f"  {name:<8}{format_bytes(tier.resident_bytes):>12}"
                f"{format_bytes(tier.peak_bytes):>12}{tier.placements:>9}"
            )
        t = self.transfers
        lines.append(
            f"  transfers: {t.count} moves, {format_bytes(t.bytes)} in {t.seconds:.3f} s; "
            f"{self.prefetches} prefetched"
        )
        return "\n".join(lines)


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _parse_budget(budget: object) -> int | None:
    if budget is None:
        return None
    return parse_bytes(budget, what="budget", subsystem="tensorscope.residency")


def _make_policy(policy: object) -> Policy:
    if isinstance(policy, str):
        factories: dict[str, Callable[[], Policy]] = {"flow": Flow, "genoa": Genoa}
        named = factories.get(policy.lower())
        if named is None:
            raise InvalidArgumentError(
                f"tensorscope.residency: unknown policy {policy!r}; use 'flow', 'genoa', "
                "ts.Flow(), ts.Genoa() or an object with evict() and after_op() (see "
                "tensorscope.policies.Policy)."
            )
        return named()
    if callable(getattr(policy, "evict", None)) and callable(getattr(policy, "after_op", None)):
        return policy  # type: ignore[return-value]
    raise ArgumentTypeError(
        f"tensorscope.residency: policy must be 'flow', 'genoa' or a Policy object; got "
        f"{type(policy).__name__}."
    )


def _tensors(args: Iterable[Any]) -> Iterable[torch.Tensor]:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    yield item


def _signature(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    try:
        hash(value)
    except TypeError:
        return ("?", id(value))
    return value  # type: ignore[no-any-return]


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(
            tuple(value.shape), value.stride(), dtype=value.dtype, device="meta"
        )
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


class _Prefetcher:
    """One daemon thread mapping pages in (CPU) while the main thread computes."""

    def __init__(self) -> None:
        import queue

        self._queue: queue.SimpleQueue[tuple[Placement, threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="tensorscope-prefetch", daemon=True)
        self._thread.start()

    def submit(self, placement: Placement, event: threading.Event) -> None:
        self._queue.put((placement, event))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            placement, event = item
            try:
                region = placement.region
                if region is not None:
                    region.populate(placement.storage.data_ptr(), write=placement.written)
            finally:
                event.set()

    def close(self) -> None:
        self._queue.put(None)


class ResidencyManager:
    """Budget, tiers and policy for managed tensors. Use the singleton ``ts.residency``.

    Example:
        >>> import torch, tensorscope as ts
        >>> ts.residency.configure(device="cpu", policy="genoa", budget="64MiB")
        >>> t = ts.ref(torch.ones(1024))
        >>> t.demote(); t.tier
        'disk'
        >>> (t + 1).sum().item(), t.tier
        (2048.0, 'disk')
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._device = _default_device()
        self._policy: Policy = Flow()
        self._budget: int | None = None
        self._offload_dir: str | None = None
        self._disk: DiskTier | None = None
        self._host: HostTier | None = None
        self._placements: dict[int, Placement] = {}
        self._by_uid: dict[int, Placement] = {}
        self._by_role: dict[Hashable, Placement] = {}
        self._bytes: dict[str, int] = dict.fromkeys(TIER_ORDER, 0)
        self._peak: dict[str, int] = dict.fromkeys(TIER_ORDER, 0)
        self._transfers = [0, 0, 0.0]
        self._prefetched = 0
        self.clock = 0
        self._since_sweep = 0
        self.recorder = Recorder()
        self._meta_cache: dict[Hashable, int] = {}
        self._prefetcher: _Prefetcher | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        self._mover: Movers | None = None
        self._busy: set[int] = set()
        self._threads: dict[int, ThreadData] = {}
        self._resident: dict[int, Placement] = {}  # uid -> placements on the device tier
        self._handles: weakref.WeakSet[Any] = weakref.WeakSet()  # live ts.manage() handles

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
                "1.5GB"; ``None`` for no limit. A smaller budget demotes at once.
            offload_dir: directory for the disk tier; ``None`` for a private temporary one.

        Raises:
            InvalidArgumentError: (a ValueError) unparsable, zero or negative budget, unknown
                policy or device.
            ResidencyError: an unwritable ``offload_dir``, or one changed while data is on disk.
        """
        with self._lock:
            new_budget = self._budget if budget is _UNSET else _parse_budget(budget)
            new_policy = self._policy if policy is _UNSET else _make_policy(policy)
            new_device = self._device if device is _UNSET else self._parse_device(device)
            if new_device != self._device:
                self._copy_stream = None
                self._mover = None
            if new_device != self._device and self._placements:
                raise ResidencyError(
                    f"tensorscope.residency: cannot move {len(self._placements)} managed tensors "
                    f"from {self._device} to {new_device}; remove() them first."
                )
            if offload_dir is not _UNSET:
                self._set_offload_dir(offload_dir)
            self._device = new_device
            if new_policy is not self._policy:
                self._policy = new_policy
                self.recorder.reset()
            self._budget = new_budget
            self._peak = dict(self._bytes)
            if new_budget is not None and self._bytes["device"] > new_budget:
                self._make_room(self._bytes["device"] - new_budget, what="configure(budget=...)")

    def _parse_device(self, device: object) -> torch.device:
        try:
            parsed: torch.device = torch.device(device)  # type: ignore[call-overload]
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgumentError(
                f"tensorscope.residency: unknown device {device!r}; use 'cpu' or 'cuda'."
            ) from exc
        if parsed.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgumentError(
                "tensorscope.residency: device 'cuda' asked for but CUDA is not available; "
                "use device='cpu' (the disk tier then backs the CPU)."
            )
        if parsed.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(
                f"tensorscope.residency: device {parsed} is not supported; use 'cpu' or 'cuda'."
            )
        return parsed

    def _set_offload_dir(self, offload_dir: str | os.PathLike[str] | None) -> None:
        wanted = None if offload_dir is None else os.path.abspath(os.fspath(offload_dir))
        if wanted == self._offload_dir and self._disk is not None:
            return
        if any(p.region is not None for p in self._placements.values()):
            raise ResidencyError(
                "tensorscope.residency: cannot change offload_dir while data lives on the disk "
                "tier; promote or remove() those tensors first."
            )
        disk = DiskTier(wanted)  # raises ResidencyError if it cannot be created or written
        if self._disk is not None:
            self._disk.close()
        self._disk = disk
        self._offload_dir = wanted

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
    def tiers(self) -> tuple[TierName, ...]:
        """The tiers in use, top to bottom (no host tier when the device is the CPU)."""
        if self._device.type == "cpu":
            return ("device", "disk")
        return TIER_ORDER

    # ------------------------------------------------------------------------------- report
    def report(self, reset: bool = False) -> ResidencyReport:
        """Resident and peak bytes per tier, transfers, prefetches. ``reset`` restarts peaks."""
        with self._lock:
            self._sweep()
            counts: dict[str, int] = dict.fromkeys(self.tiers, 0)
            for placement in self._placements.values():
                counts[placement.tier] = counts.get(placement.tier, 0) + 1
            tiers: dict[str, TierReport] = {
                name: TierReport(self._bytes[name], self._peak[name], counts.get(name, 0))
                for name in self.tiers
            }
            count, nbytes, seconds = self._transfers
            rep = ResidencyReport(
                str(self._device),
                getattr(self._policy, "name", type(self._policy).__name__),
                self._budget,
                tiers,
                Transfers(int(count), int(nbytes), float(seconds)),
                self._prefetched,
            )
            if reset:
                self._peak = dict(self._bytes)
                self._transfers = [0, 0, 0.0]
                self._prefetched = 0
            return rep

    # ------------------------------------------------------------------------ registration
    def placement_of(self, tensor: torch.Tensor) -> Placement | None:
        """The placement managing ``tensor``'s storage, or None."""
        if tensor.layout is not torch.strided or tensor.device.type == "meta":
            return None
        return self._placements.get(storage_address(tensor))

    def register(
        self, tensor: torch.Tensor, role: Hashable | None = None, group: int = 0
    ) -> Placement:
        """Manage ``tensor``'s storage (idempotent); it starts on the device tier."""
        with self._lock:
            existing = self.placement_of(tensor)
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
            self._add(placement)
            self._intercept_here()
            return placement

    def _intercept_here(self) -> None:
        """Make sure ops on this thread go through the manager (until nothing is managed)."""
        from tensorscope import _intercept
        from tensorscope._state import thread_data

        data = thread_data()
        if data.thread_id not in self._threads:
            _intercept.activate_residency(data, self)
            self._threads[data.thread_id] = data

    def _stop_intercepting(self) -> None:
        """Nothing is managed any more: this thread runs torch untouched again."""
        import threading as _threading

        from tensorscope import _intercept

        data = self._threads.pop(_threading.get_ident(), None)
        if data is not None:
            _intercept.deactivate_residency(data)

    def _add(self, placement: Placement) -> None:
        self._placements[placement.key] = placement
        self._by_uid[placement.uid] = placement
        self._by_role[placement.role] = placement
        self._account(placement.tier, placement.nbytes)
        self._track(placement)

    def _track(self, placement: Placement) -> None:
        """Keep the set of device-resident placements in step with ``placement.tier``."""
        if placement.tier == "device":
            self._resident[placement.uid] = placement
        else:
            self._resident.pop(placement.uid, None)

    def _account(self, tier: str, delta: int) -> None:
        total = self._bytes[tier] + delta
        self._bytes[tier] = total
        if total > self._peak[tier]:
            self._peak[tier] = total

    def _forget(self, placement: Placement) -> None:
        placement.wait()
        self._placements.pop(placement.key, None)
        self._by_uid.pop(placement.uid, None)
        self._resident.pop(placement.uid, None)
        if self._by_role.get(placement.role) is placement:
            del self._by_role[placement.role]
        self._account(placement.tier, -placement.nbytes)
        if placement.region is not None:
            placement.region.close()

    def unregister(self, placement: Placement) -> None:
        """Stop managing: the bytes go back to ordinary device memory."""
        with self._lock:
            if self._placements.get(placement.key) is not placement:
                return
            placement.wait()
            source = placement.tier
            self._movers().materialize(placement)
            self._account(source, -placement.nbytes)
            self._account("device", placement.nbytes)
            self._forget(placement)

    def _sweep(self, keys: Iterable[int] | None = None) -> None:
        """Forget placements whose storage nothing but the placement still holds."""
        self._since_sweep = 0
        candidates = (
            list(self._placements.values())
            if keys is None
            else [p for k in keys if (p := self._placements.get(k)) is not None]
        )
        for placement in candidates:
            if not placement.alive_elsewhere():
                self._forget(placement)
        if not self._placements and self._threads:
            self._stop_intercepting()

    def managed_count(self) -> int:
        return len(self._placements)

    def holds(self, key: int) -> int:
        """References this manager holds to the storage ``key`` (for disposal accounting)."""
        return 1 if key in self._placements else 0

    def on_disposed(self, keys: list[int]) -> None:
        """Refs of these storages were disposed: forget placements nothing else holds."""
        if any(key in self._placements for key in keys):
            with self._lock:
                self._sweep(keys)

    # ------------------------------------------------------------------------------- moves
    def _movers(self) -> Movers:
        if self._disk is None:
            self._disk = DiskTier(self._offload_dir)
        if self._device.type == "cuda":
            if self._host is None:
                self._host = HostTier()
            if self._copy_stream is None:
                self._copy_stream = cuda_stream(self._device)
        if self._mover is None or self._mover.disk is not self._disk:
            self._mover = Movers(
                DeviceTier(self._device), self._host, self._disk, self._copy_stream
            )
        return self._mover

    def flush_disk(self) -> None:
        """Write dirty offload pages to disk now, so background writeback does not compete
        with the next iterations (called once by ``ts.manage()``)."""
        with self._lock:
            for placement in self._placements.values():
                if placement.region is not None:
                    placement.region.flush()

    def release_heap(self, threshold: int = 64 << 20) -> None:
        """Return heap memory freed by first demotions to the OS once enough has piled up."""
        mover = self._mover
        if mover is not None and mover.migrated_bytes >= threshold:
            mover.migrated_bytes = 0
            release_free_heap()

    def _on_iteration_end(self) -> None:
        self._sweep()
        self.release_heap()

    def _lower(self, tier: str) -> TierName:
        tiers = self.tiers
        index = tiers.index(tier)  # type: ignore[arg-type,unused-ignore]
        return tiers[min(index + 1, len(tiers) - 1)]

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

    def _demote(self, placement: Placement, target: TierName | None = None) -> None:
        source = placement.tier
        target = target or self._lower(source)
        if TIER_ORDER.index(target) <= TIER_ORDER.index(source):
            return
        seconds = self._movers().demote(placement, target)  # raises before changing anything
        self._track(placement)
        self._account(source, -placement.nbytes)
        self._account(target, placement.nbytes)
        self._count_transfer(placement.nbytes, seconds)
        self.release_heap()

    def _promote(self, placement: Placement) -> None:
        if placement.tier == "device":
            return
        movers = self._movers()
        movers.check_readable(placement)
        source = placement.tier
        seconds = movers.promote(placement)
        self._track(placement)
        self._account(source, -placement.nbytes)
        self._account("device", placement.nbytes)
        self._count_transfer(placement.nbytes, seconds)

    def _prefetch(self, placement: Placement) -> None:
        """Account a placement as resident now; its bytes arrive in the background (pages
        mapped by the prefetch thread on a CPU device, a copy stream on CUDA)."""
        movers = self._movers()
        if self._device.type == "cuda":
            movers.check_readable(placement)
            source = placement.tier
            seconds = movers.promote(placement, background=True)
            self._track(placement)
            self._account(source, -placement.nbytes)
            self._account("device", placement.nbytes)
            self._count_transfer(placement.nbytes, seconds)
            self._prefetched += 1
            return
        if placement.tier != "disk":
            self._promote(placement)
            return
        movers.check_readable(placement)
        if self._prefetcher is None:
            self._prefetcher = _Prefetcher()
        event = threading.Event()
        placement.pending = event
        placement.tier = "device"
        self._track(placement)
        self._account("disk", -placement.nbytes)
        self._account("device", placement.nbytes)
        self._count_transfer(placement.nbytes, 0.0)
        self._prefetched += 1
        self._prefetcher.submit(placement, event)

    def _count_transfer(self, nbytes: int, seconds: float) -> None:
        self._transfers[0] += 1
        self._transfers[1] += nbytes
        self._transfers[2] += seconds

    def demote(self, tensor: torch.Tensor, tier: str | None = None) -> None:
        """Move ``tensor``'s data down to ``tier`` (default: the next tier below its own)."""
        with self._lock:
            target = None if tier is None else self._check_tier(tier)
            placement = self.register(tensor)
            self._demote(placement, target)

    def promote(self, tensor: torch.Tensor) -> None:
        """Bring ``tensor``'s data to the device tier, making room under the budget."""
        with self._lock:
            placement = self.placement_of(tensor)
            if placement is None or placement.tier == "device":
                return
            self._busy = {placement.uid}
            try:
                self._check_fits(placement.nbytes, "promote()")
                self._make_room(placement.nbytes, what="promote()")
                self._promote(placement)
            finally:
                self._busy = set()

    def tier_of(self, tensor: torch.Tensor) -> TierName:
        placement = self.placement_of(tensor)
        if placement is not None:
            return placement.tier
        return "device" if tensor.device.type == self._device.type else "host"

    # ------------------------------------------------------------------------ making room
    def _check_fits(self, nbytes: int, what: str) -> None:
        if self._budget is not None and nbytes > self._budget:
            raise OutOfBudgetError(
                f"tensorscope.residency: {what} needs {format_bytes(nbytes)} on the device at "
                f"once, more than the whole budget of {format_bytes(self._budget)}. Nothing was "
                "moved. Raise the budget (ts.residency.configure(budget=...)) or split the op."
            )

    def _snapshot(self, upcoming: bool = False) -> Snapshot:
        recorder = self.recorder
        busy = set(self._busy)
        resident = list(self._resident.values())

        def entries() -> tuple[Entry, ...]:
            return tuple(
                Entry(p.uid, p.nbytes, p.tier, p.last_use, recorder.next_use(p.role), p.uid in busy)
                for p in resident
            )

        ahead: tuple[Entry, ...] = ()
        if upcoming and recorder.predicting:
            wanted = []
            for role in recorder.upcoming(32):
                p = self._by_role.get(role)
                if p is not None and p.tier != "device":
                    wanted.append(
                        Entry(p.uid, p.nbytes, p.tier, p.last_use, recorder.next_use(role), False)
                    )
            ahead = tuple(wanted)
        return Snapshot(
            self._budget, self._bytes["device"], self.clock, None, ahead, make_entries=entries
        )

    def _make_room(self, needed: int, what: str) -> None:
        budget = self._budget
        if budget is None or self._bytes["device"] + needed <= budget:
            return
        if self._since_sweep > 8:
            self._sweep()  # placements nothing holds any more free room for nothing
        shortfall = self._bytes["device"] + needed - budget
        if shortfall <= 0:
            return
        for key in self._policy.evict(self._snapshot(), shortfall):
            placement = self._by_uid.get(key)
            if placement is None or placement.tier != "device" or placement.uid in self._busy:
                continue
            self._demote(placement)
            if self._bytes["device"] + needed <= budget:
                return
        # The policy freed too little: the budget is a hard limit, so demote LRU-first.
        idle = sorted(
            (p for p in self._resident.values() if p.uid not in self._busy),
            key=lambda p: p.last_use,
        )
        for placement in idle:
            if self._bytes["device"] + needed <= budget:
                return
            self._demote(placement)
        if self._bytes["device"] + needed > budget:
            raise OutOfBudgetError(
                f"tensorscope.residency: {what} needs {format_bytes(needed)} more on the device "
                f"but only {format_bytes(budget - self._bytes['device'])} of the "
                f"{format_bytes(budget)} budget can be freed. Raise the budget."
            )

    # ----------------------------------------------------------------------------- op path
    def operands(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[Placement]:
        """The distinct placements of the managed tensors among an op's arguments."""
        found: list[Placement] = []
        placements = self._placements
        address_of = storage_address
        for source in (args, kwargs.values()) if kwargs else (args,):
            for tensor in _tensors(source):
                if tensor.layout is not torch.strided or tensor.device.type == "meta":
                    continue
                placement = placements.get(address_of(tensor))
                if placement is not None and placement not in found:
                    found.append(placement)
        return found

    def before_op(self, func: Any, operands: list[Placement], results_nbytes: int) -> None:
        """Make the operands resident (and room for managed results) before ``func`` runs."""
        with self._lock:
            self.clock += 1
            self._since_sweep += 1
            if self._since_sweep >= _SWEEP_EVERY:
                self._sweep()
            name = str(func)
            total = sum(p.nbytes for p in operands) + results_nbytes
            self._check_fits(total, f"op {name} (operands and results)")
            self._busy = {p.uid for p in operands}
            missing = [p for p in operands if p.tier != "device"]
            self._make_room(sum(p.nbytes for p in missing) + results_nbytes, f"op {name}")
            movers = self._movers() if missing else None
            for placement in missing:
                assert movers is not None
                movers.check_readable(placement)
            for placement in missing:
                self._promote(placement)
            for placement in operands:
                placement.wait()
            iterations = self.recorder.iterations
            self.recorder.record(func, tuple(p.role for p in operands))
            if self.recorder.iterations != iterations:
                self._on_iteration_end()  # a repeated forward began a new iteration

    def after_op(
        self,
        func: Any,
        operands: list[Placement],
        out: Any,
        manage_results: bool,
        mutating: bool,
        group: int = 0,
    ) -> list[Placement]:
        """Register managed results, then apply the policy's demotions and prefetches."""
        with self._lock:
            clock = self.clock
            for placement in operands:
                placement.last_use = clock
                if mutating:
                    placement.written = True
            results: list[Placement] = []
            if manage_results:
                # Results belong with the parameter their first operand belongs to (a grad or
                # optimizer state goes away with its parameter on remove()).
                if not group and operands:
                    group = operands[0].group or operands[0].uid
                position = self.recorder.position
                for index, tensor in enumerate(
                    _tensors(out if isinstance(out, (list, tuple)) else (out,))
                ):
                    if tensor.layout is not torch.strided or tensor.numel() == 0:
                        continue
                    found = self._placements.get(storage_address(tensor))
                    if found is None:
                        placement = Placement(
                            tensor.untyped_storage(), ("new", position, index), group
                        )
                        placement.last_use = clock
                        self._add(placement)
                    else:
                        placement = found
                        if placement.group != group and placement not in operands:
                            placement.group = group  # e.g. an activation's storage became a .grad
                    results.append(placement)
            self._busy = {p.uid for p in operands} | {p.uid for p in results}
            try:
                budget = self._budget
                if budget is not None and self._bytes["device"] > budget:
                    self._make_room(0, f"op {func} (results)")  # estimate was short
                policy = self._policy
                wants = getattr(policy, "wants_snapshot_after_op", True)
                snapshot = self._snapshot(upcoming=True) if wants else None
                view = OpView(
                    str(func),
                    tuple(p.uid for p in operands),
                    tuple(p.uid for p in results),
                    snapshot,
                )
                self._busy = set()
                self._apply(policy.after_op(view))
            finally:
                self._busy = set()
            return results

    def _apply(self, actions: list[Action]) -> None:
        budget = self._budget
        for action in actions:
            placement = self._by_uid.get(action.key)
            if placement is None:
                continue
            if action.kind == "demote":
                if placement.tier == "device":
                    self._demote(placement)
            elif action.kind == "prefetch" and placement.tier != "device":
                if budget is not None and self._bytes["device"] + placement.nbytes > budget:
                    continue  # the policy's plan no longer fits: skip, the op will promote
                self._prefetch(placement)

    def estimate_results(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Bytes of fresh results ``func`` will allocate (meta run, cached per signature)."""
        try:
            key: Hashable = (func, _signature(args), _signature(kwargs))
            hash(key)
        except TypeError:
            key = None
        if key is not None:
            cached = self._meta_cache.get(key)
            if cached is not None:
                return cached
        nbytes = self._meta_run(func, args, kwargs)
        if key is not None:
            self._meta_cache[key] = nbytes
        return nbytes

    @staticmethod
    def _meta_run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        try:
            meta_args = _to_meta(args)
            meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
            inputs = {storage_address(t) for t in _tensors((*meta_args, *meta_kwargs.values()))}
            with torch._C._DisableTorchDispatch(), torch.no_grad():
                out = func._op(*meta_args, **meta_kwargs)
        except Exception:  # no meta kernel: accounted after the op instead
            return 0
        total = 0
        for tensor in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
            if storage_address(tensor) not in inputs:
                total += tensor.untyped_storage().nbytes()
        return total

    def iteration_boundary(self) -> None:
        """End of an iteration (an optimizer step): the trace so far predicts the next one."""
        with self._lock:
            self.recorder.boundary()
            self._on_iteration_end()

    def reset(self) -> None:
        """Forget everything managed (data back in ordinary memory), statistics and settings'
        history; ``ts.manage`` handles are removed. Configuration is kept."""
        for handle in list(self._handles):
            handle.remove()
        with self._lock:
            for placement in list(self._placements.values()):
                self.unregister(placement)
            self._sweep()
            self._bytes = dict.fromkeys(TIER_ORDER, 0)
            self._peak = dict.fromkeys(TIER_ORDER, 0)
            self._transfers = [0, 0, 0.0]
            self._prefetched = 0
            self.recorder.reset()
            self._meta_cache.clear()


residency = ResidencyManager()
STORAGE_HOLDERS.append(residency.holds)
DISPOSAL_LISTENERS.append(residency.on_disposed)
