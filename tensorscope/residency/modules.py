"""What the residency manager does for ``ts.manage()``: modules' tensors registered under a
budget, checkpoint tensors placed on the disk tier, tensors let go again, ``reset()``.

A mixin of :class:`~tensorscope.residency.manager.ResidencyManager` (kept apart so that the
manager's module stays about configuration, registration and moves); it uses the manager's
lock, ledger and moves, declared below for the type checker.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
import weakref
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from tensorscope._torch import no_dispatch, tensor_over
from tensorscope.errors import ResidencyError, ResidencyWarning
from tensorscope.residency import native
from tensorscope.residency.checkpoint_files import StoredTensor
from tensorscope.residency.ledger import Ledger
from tensorscope.residency.movers import Movers, describe, lost_on_remove
from tensorscope.residency.placement import Placement
from tensorscope.residency.tiers import TierName, release_free_heap

if TYPE_CHECKING:
    from tensorscope.graph.order import ModuleOrder
    from tensorscope.graph.record import Recorder
    from tensorscope.residency.backends import Backend
    from tensorscope.residency.cadence import Cadence
    from tensorscope.residency.disk import DiskTier
    from tensorscope.residency.oppath import OpPath
    from tensorscope.residency.prefetch import Prefetcher

__all__ = ["ModuleSupport"]


class ModuleSupport:
    """``ts.manage()``'s side of the manager (see the module docstring)."""

    if TYPE_CHECKING:  # provided by ResidencyManager
        _lock: threading.RLock
        _budget: int | None
        _device: torch.device
        _disk: DiskTier | None
        _movers: Movers | None
        _prefetcher: Prefetcher | None
        _handles: weakref.WeakSet[Any]
        _recorders: dict[int, Recorder]
        _landed_late: collections.deque[Any]
        _threads: dict[int, Any]
        ledger: Ledger
        order: ModuleOrder
        ops: OpPath
        cadence: Cadence
        converted: int

        @property
        def disk(self) -> DiskTier: ...

        @property
        def backend(self) -> Backend: ...

        def movers(self) -> Movers: ...

        def make_room(self, needed: int, what: str, *, holding_pins: bool = False) -> None: ...

        def register(
            self, tensor: torch.Tensor, role: Hashable | None = None, group: int = 0
        ) -> Placement: ...

        def add(self, placement: Placement) -> None: ...

        def attach_thread(self) -> None: ...

        def _detach_threads(self) -> None: ...

        def demote_placement(
            self, placement: Placement, target: TierName | None = None
        ) -> bool: ...

        def unregister(self, placement: Placement, lost: str = "keep") -> str | None: ...

        def sweep(self, keys: Iterable[int] | None = None) -> None: ...

    # ------------------------------------------------------------------------ ts.manage()
    def manage_tensor(
        self, tensor: torch.Tensor, role: Hashable | None, group: int = 0
    ) -> Placement:
        """Register a module's tensor for ``ts.manage()`` (or a gradient of one, in ``group``):
        room is made first, so the accounted peak stays within the budget from the start; a
        tensor larger than the whole budget starts on the tier below."""
        with self._lock:
            budget = self._budget
            if self.ledger.find(tensor) is None and budget is not None:
                nbytes = tensor.untyped_storage().nbytes()
                if nbytes <= budget:
                    self.make_room(nbytes, "ts.manage()")
            placement = self.register(tensor, role=role, group=group)
            if isinstance(tensor, torch.nn.Parameter):  # buffers are used out of module order
                self.order.add(placement.role, placement.nbytes)
            if budget is not None and placement.nbytes > budget:
                self.demote_placement(placement)
            return placement

    def claim(self, placement: Placement, role: Hashable) -> None:
        """A placement made by an op (``module.half()`` in a scope) becomes a module's tensor,
        named ``role``: it leaves its group and takes part in the first iteration's guess."""
        with self._lock:
            self.ledger.rename(placement, role)
            placement.group = 0
            self.order.add(role, placement.nbytes)

    def settle(self, uids: set[int], whole: bool = True) -> None:
        """End of ``ts.manage()``: under a budget on a CPU device, the weights that stay
        resident move into the disk tier's files too (still mapped), so all of their old heap
        memory goes back to the OS now rather than during the first forward; then the files
        are flushed (written back now, not while the first iterations run). ``whole=False``
        (a few tensors added later): no trim of the heap below 64 MiB, no flush."""
        with self._lock:
            self.make_room(0, "ts.manage()")
            if self._budget is not None:
                self.back_with_files(uids)
            self.release_heap(threshold=0 if whole else 64 << 20)
        if whole:
            self.flush_disk()

    def unmanage(self, uids: set[int]) -> None:
        """Stop managing these placements and everything grouped with them (their grads and
        optimizer state): plain memory again.

        Raises:
            ResidencyError: some of them lost their bytes (a checkpoint truncated or changed
                behind the manager's back); they stay managed, every other one was let go.
        """
        lost: list[tuple[Placement, str]] = []
        with self._lock:
            for placement in list(self.ledger.placements.values()):
                if placement.uid in uids or placement.group in uids:
                    reason = self.unregister(placement)
                    if reason is not None:
                        lost.append((placement, reason))
            self.sweep()
        if lost:
            raise lost_on_remove(lost)

    def place_stored(
        self, stored: StoredTensor, dtype: torch.dtype, role: Hashable, parameter: bool = True
    ) -> tuple[torch.Tensor, Placement]:
        """A tensor holding a checkpoint's stored value, managed on the disk tier: its memory
        is the checkpoint file itself when the dtypes agree (no copy), else an offload file
        holding the value converted once (see checkpoint_files.py's NOTE). Parameters take part
        in the first iteration's guess (``self.order``); buffers are used out of module order
        (a position-id buffer first, though registered last)."""
        with self._lock:
            disk = self.disk
            region = disk.checkpoint_region(stored.path, stored.offset, stored.nbytes)
            if stored.dtype != dtype:
                try:
                    with no_dispatch():
                        source = tensor_over(region.storage(), stored.dtype, stored.shape)
                        converted = source.to(dtype).contiguous()
                    region_converted = disk.store(converted.data_ptr(), converted.nbytes)
                finally:
                    disk.release(region, reusable=False)
                del source, converted
                region = region_converted
                self.converted += 1
            if not self.backend.maps_files:  # the region is the disk copy of device memory
                self.make_room(region.nbytes, "ts.manage()")
                tensor = torch.empty(stored.shape, dtype=dtype, device=self._device)
                placement = Placement(tensor.untyped_storage(), role, 0)
                # On the disk tier at once, its memory given back unwritten: the region holds
                # its bytes (a demotion would copy the empty tensor over a converted value).
                self.backend.release(placement.storage)
                placement.region = region
                placement.tier = "disk"
                self.add(placement)
            else:  # the region is the tensor's memory (no page touched yet)
                tensor = tensor_over(region.storage(), dtype, stored.shape)
                placement = Placement(tensor.untyped_storage(), role, 0)
                placement.region = region
                placement.tier = "disk"
                self.add(placement)
            if parameter:
                self.order.add(placement.role, placement.nbytes)
            self.attach_thread()
            return tensor, placement

    def relocate(self, placement: Placement) -> None:
        """Copy on first write (see checkpoint_files.py's NOTE)."""
        with self._lock:
            self.movers().relocate(placement)
            native.publish(placement)

    def replace_lost(self, placement: Placement) -> None:
        """A placement whose bytes are lost gets new memory on the device, for an op that
        overwrites all of it (room is made by the caller)."""
        with self._lock:
            source = placement.tier
            self.movers().replace_lost(placement)
            self.ledger.moved(placement, source, 0.0)

    def add_handle(self, handle: Any) -> None:
        self._handles.add(handle)

    # ------------------------------------------------------------------ CPU file backing
    def back_with_files(self, uids: set[int]) -> None:
        """CPU device: move the heap memory of these device-resident placements into mapped
        disk regions; a full disk leaves them where they are."""
        if not self.backend.maps_files:
            return
        movers = self.movers()
        for placement in list(self.ledger.resident.values()):
            if placement.uid in uids:
                try:
                    movers.back_with_file(placement)
                except ResidencyError:
                    return  # no room on disk: they stay in heap memory, which works too

    def flush_disk(self) -> None:
        """Write dirty offload pages to disk now, so background writeback does not compete
        with the next iterations (called once by ``ts.manage()``)."""
        with self._lock:
            if self._disk is not None:
                self._disk.flush()

    def release_heap(self, threshold: int = 64 << 20) -> None:
        """Return heap memory freed by first demotions to the OS once enough has piled up."""
        movers = self._movers
        if movers is not None and movers.migrated_bytes >= threshold:
            movers.migrated_bytes = 0
            release_free_heap()

    def reset(self) -> None:
        """Forget everything managed (data back in ordinary memory), statistics and traces;
        ``ts.manage`` handles are removed. Configuration is kept, but every resource is
        released: the offload files are closed and unmapped, checkpoint files unmapped, the
        private offload directory removed and the prefetch threads ended (the offload
        directory can be unmounted now); the next move makes new ones."""
        poisoned: list[tuple[Placement, str]] = []
        for handle in list(self._handles):
            with contextlib.suppress(ResidencyError):  # lost bytes: poisoned below
                handle.remove()
        with self._lock:
            for placement in list(self.ledger.placements.values()):
                reason = self.unregister(placement, lost="poison")
                if reason is not None:
                    poisoned.append((placement, reason))
            self.sweep()
            if native.ENGINE is not None:
                native.ENGINE.res_drain()  # this thread's unreplayed fast ops: forgotten too
            self.ledger = Ledger()
            self._recorders.clear()
            self.cadence.every_op()
            self._landed_late.clear()
            self.order.clear()
            self.ops.clear_cache()
            if self._threads:
                self._detach_threads()
            if self._prefetcher is not None:
                self._prefetcher.close()
                self._prefetcher = None
            if self._disk is not None:
                self._disk.close()
                self._disk = None
            self._movers = None
        if poisoned:
            names = ", ".join(f"{describe(p)} ({why})" for p, why in poisoned[:10])
            warnings.warn(
                f"tensorscope.residency: reset() let go of {len(poisoned)} tensor(s) whose bytes "
                f"were lost: {names}. They now hold NaN (integers: -1), not their values.",
                ResidencyWarning,
                stacklevel=2,
            )
