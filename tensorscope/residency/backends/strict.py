"""The strict backend: the CUDA backend's semantics on the CPU, with late copies (for tests).

``TENSORSCOPE_BACKEND=strict`` makes it the backend of CPU devices (read when
``ts.residency.configure()`` runs, and when fit's offload makes its store). Device memory is
ordinary CPU memory, but the tiers are CUDA's (device, host, disk) and every move copies, as on
CUDA: the code the CUDA backend runs (movers.py's copy paths, fit's host store) runs here,
and what synchronous CPU copies would hide fails deterministically.

# NOTE [late copies]
# A copy on a copy stream does not run when it is queued: its destination is filled with poison
# at once (0xFF bytes: NaN in every floating dtype, -1 in signed integers, all bits set in
# unsigned ones and in bools' bytes) and the copy lands -- reads its source, writes its
# destination -- only when it is waited: ``synchronize()``, or ``wait()`` for a copy to the
# device (ops read device memory on the CPU at once). ``wait()`` of a copy to the host only
# orders what the compute stream queues after it (a copy on the compute stream, or a copy
# stream's next copy, which waits for the compute stream): the host itself must
# ``synchronize()`` before it reads the bytes, as on CUDA. Copies on one stream land in order,
# and a stream more than _BEHIND copies behind lands its oldest. The source is read at
# landing, so a source changed meanwhile is copied changed. The device memory a copy uses must
# still be in the storage it was queued with, or have been given back through ``release``
# (which hands it to the copy): otherwise landing raises ``ResidencyError``. As
# ``record_stream`` keeps a CUDA block for its copies, the storage a copy reads is kept alive
# for it, and a copy to a device storage that died meanwhile lands nowhere (nothing can read
# it). So a missing wait reads poison, and
# memory taken from under a copy raises, where synchronous CPU copies would pass. Copies on
# the compute stream, and copies of pageable memory (blocking), run at once, as on CUDA. For
# tests: ``device_full`` makes every device allocation raise torch's ``OutOfMemoryError``;
# the pool's ``limit`` bounds pinned memory.
"""

from __future__ import annotations

import threading
import weakref

import torch

from tensorscope._torch import new_storage, no_dispatch, tensor_over
from tensorscope.errors import ResidencyError
from tensorscope.residency.backends.base import CPU, DONE, Backend, Pending
from tensorscope.residency.backends.pinned import PinnedPool, default_limit

__all__ = ["POISON", "StrictBackend", "StrictCopy"]

POISON = 0xFF
_BEHIND = 256  # copies a stream may be behind: the oldest lands then (a GPU gets to it too)


def _poison(storage: torch.UntypedStorage) -> None:
    if storage.nbytes():
        with no_dispatch():
            tensor_over(storage, torch.uint8, (storage.nbytes(),)).fill_(POISON)


class StrictCopy:
    """A copy queued on a copy stream, landing when waited (see the NOTE)."""

    __slots__ = (
        "__weakref__",
        "address",
        "backend",
        "deps",
        "device",
        "host",
        "kept",
        "landed",
        "stream",
        "to_device",
    )

    def __init__(
        self,
        backend: StrictBackend,
        device: torch.UntypedStorage,
        host: torch.UntypedStorage,
        to_device: bool,
        deps: list[StrictCopy],
    ) -> None:
        self.backend = backend
        self.to_device = to_device
        self.stream = "in" if to_device else "out"
        # Host memory lives as long as the copy (rule 5). The device memory a copy reads is kept
        # for it, as record_stream keeps a CUDA block (and ``release`` hands over the memory
        # that left the storage); a device storage a copy writes is followed weakly: dead, it
        # is written nowhere.
        self.device = weakref.ref(device)
        self.address = device.data_ptr()
        self.host: torch.UntypedStorage | None = host
        self.kept: torch.UntypedStorage | None = None if to_device else device
        self.deps = deps  # copies the compute stream waited for when this one was queued
        self.landed = False

    def wait(self) -> None:
        self.backend.wait_for(self)

    def synchronize(self) -> None:
        self.backend.land(self)


class StrictBackend(Backend):
    """CUDA's semantics on the CPU (see the NOTE)."""

    name = "strict"
    maps_files = False
    heap_device = True
    host_tier = True

    def __init__(self, device: torch.device = CPU, pool: PinnedPool | None = None) -> None:
        super().__init__(device, pool or PinnedPool(self._pin, default_limit()))
        self.device_full = False
        self.landed_late = 0  # copies landed at a wait (not when queued)
        self._lock = threading.RLock()  # copies are queued and waited on several threads
        self._queued: dict[str, list[StrictCopy]] = {"in": [], "out": []}  # not landed, in order
        self._ordered: list[StrictCopy] = []  # to the host, waited by the compute stream only

    def _pin(self, nbytes: int) -> torch.UntypedStorage:
        return new_storage(nbytes, CPU)

    def _allocate(self, nbytes: int, seen: bool) -> torch.UntypedStorage:
        if self.device_full:
            raise torch.OutOfMemoryError(
                f"strict backend: device memory is full (device_full); tried to allocate "
                f"{nbytes} bytes"
            )
        return super()._allocate(nbytes, seen)

    def _copy(
        self,
        dst: torch.UntypedStorage,
        src: torch.UntypedStorage,
        *,
        to_device: bool,
        background: bool,
        pinned: bool,
    ) -> Pending:
        with self._lock:
            deps = list(self._ordered)
            if not (pinned and background):  # compute stream, or blocking: it runs now
                for dep in deps:
                    self.land(dep)
                if background:  # a copy stream's earlier copies come first
                    for earlier in list(self._queued["in" if to_device else "out"]):
                        self.land(earlier)
                with no_dispatch():
                    dst.copy_(src)
                return DONE
            device, host = (dst, src) if to_device else (src, dst)
            copy = StrictCopy(self, device, host, to_device, deps)
            _poison(dst)
            queue = self._queued[copy.stream]
            queue.append(copy)
            if len(queue) > _BEHIND:
                self.land(queue[0])
            return copy

    def wait_for(self, copy: StrictCopy) -> None:
        """The compute stream waits for ``copy`` (see the NOTE)."""
        if copy.to_device:
            self.land(copy)
            return
        with self._lock:
            if not copy.landed and copy not in self._ordered:
                self._ordered.append(copy)

    def land(self, copy: StrictCopy) -> None:
        """Run ``copy`` now, after what it waits for and what was queued before it."""
        with self._lock:
            if copy.landed:
                return
            copy.landed = True
            queue = self._queued[copy.stream]
            at = queue.index(copy) if copy in queue else -1
            earlier = queue[:at] if at > 0 else []
            del queue[: at + 1]
            if copy in self._ordered:
                self._ordered.remove(copy)
            for dep in copy.deps:
                self.land(dep)
            for other in earlier:  # copies on one stream land in order
                self.land(other)
            device = copy.kept if copy.kept is not None else copy.device()
            host = copy.host
            copy.deps, copy.host, copy.kept = [], None, None
            if device is None:
                return  # a device storage it wrote died unread (see __init__)
            if device.data_ptr() != copy.address:
                way = "writes" if copy.to_device else "reads"
                raise ResidencyError(
                    f"tensorscope.residency (strict backend): a copy {way} device memory that "
                    "left its storage before the copy landed. Device memory may leave a storage "
                    "only through Backend.release while a copy uses it (base.py's NOTE [the copy "
                    "rules], 4): on CUDA the allocator would reuse the block under the copy."
                )
            assert host is not None  # set until landed
            with no_dispatch():
                if copy.to_device:
                    device.copy_(host)
                else:
                    host.copy_(device)
            self.landed_late += 1

    def _retire(self, old: torch.UntypedStorage, left: torch.UntypedStorage) -> None:
        """``release``: copies still using this memory keep it until they land."""
        address = old.data_ptr()
        if not address:
            return
        with self._lock:
            for queue in self._queued.values():
                for copy in queue:
                    mine = copy.kept is left or (copy.kept is None and copy.device() is left)
                    if mine and copy.address == address:
                        copy.kept = old

    def synchronize(self) -> None:
        with self._lock:
            for queue in self._queued.values():
                while queue:
                    self.land(queue[0])
