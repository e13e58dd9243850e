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
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch

from tensorscope._oppath import OpPath
from tensorscope._placement import Movers, Placement
from tensorscope._prefetch import Prefetcher
from tensorscope._report import ResidencyReport, TierReport, Transfers
from tensorscope._state import DISPOSAL_LISTENERS, STORAGE_HOLDERS
from tensorscope._torch import storage_address
from tensorscope._units import parse_bytes
from tensorscope.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    ResidencyError,
)
from tensorscope.graph.record import Recorder
from tensorscope.policies import Flow, Genoa, Policy
from tensorscope.tiers import (
    TIER_ORDER,
    DiskTier,
    HostTier,
    TierName,
)

if TYPE_CHECKING:
    from tensorscope._state import ThreadData

__all__ = ["ResidencyManager", "ResidencyReport", "TierReport", "Transfers", "residency"]

_UNSET: Any = object()


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


class ResidencyManager(OpPath):
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
        self._prefetcher: Prefetcher | None = None
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
                "tensorscope.residency: cannot change offload_dir while managed tensors live in "
                "its files; remove() them (handle.remove(), or let them die) first."
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
