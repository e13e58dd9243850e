"""A placement: one managed storage and which tier its bytes are on.

Placements are keyed by the address of the storage's ``StorageImpl``: every tensor sharing the
storage (views, autograd's saved copies, an optimizer's reference, the wrapper autograd makes
when it unpacks a saved tensor) finds the same placement, whatever Python object it is.
The placement holds one reference to the storage; when that is the only one left (the storage's
use count is 1), nothing else can use the bytes and the manager forgets the placement.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Hashable

import torch

from tensorscope._torch import storage_use_count
from tensorscope.residency import native
from tensorscope.residency.backends import Pending
from tensorscope.residency.mapping import DiskRegion
from tensorscope.residency.tiers import TierName

__all__ = ["Placement"]

_uids = itertools.count(1)


class Placement:
    """Where one managed storage's bytes are."""

    __slots__ = (
        "_region",
        "group",
        "host",
        "key",
        "last_use",
        "nbytes",
        "owner",
        "pending",
        "pins",
        "restore",
        "role",
        "storage",
        "tier",
        "uid",
        "written",
    )

    def __init__(self, storage: torch.UntypedStorage, role: Hashable | None, group: int) -> None:
        self.uid = next(_uids)
        self.storage = storage
        self.key = int(storage._cdata)
        self.nbytes = storage.nbytes()
        self.tier: TierName = "device"
        self._region: DiskRegion | None = None  # the disk copy (CPU device: the memory itself)
        self.host: torch.UntypedStorage | None = None  # host copy (backends with a host tier)
        self.role: Hashable = self.uid if role is None else role  # identity across iterations
        self.group = group  # uid of the parameter this belongs to (its grad, optimizer state)
        self.last_use = -1
        # A move in flight: a prefetch thread's Event (CPU), or the backend's copy (a prefetch
        # to the device, a demotion to the host: base.py's NOTE [the copy rules]).
        self.pending: threading.Event | Pending | None = None
        self.written = False
        self.pins = 0  # ops in flight (on any thread) that use it: it must stay on the device
        # The objects of a managed parameter/buffer (the module's, and aliases made by
        # ``nn.Parameter(p)``) and their classes before ts.manage(), restored when unmanaged.
        self.restore: list[tuple[weakref.ref[torch.Tensor], type[torch.Tensor]]] = []
        self.owner: weakref.ref[object] | None = None  # the ts.manage() handle, if any

    @property
    def region(self) -> DiskRegion | None:
        """The disk copy (CPU device: the memory itself), or None."""
        return self._region

    @region.setter
    def region(self, region: DiskRegion | None) -> None:
        self._region = region
        native.publish(self, create=False)  # the C++ op path checks where its memory lies

    def alive_elsewhere(self) -> bool:
        """Whether anything but this placement still holds the storage."""
        return storage_use_count(self.key) > 1

    def wait(self, host: bool = False) -> None:
        """Wait for a move of this placement in flight (if any): its bytes are where its tier
        says for the ops queued after this on the current stream (a copy: the stream waits for
        it, the host goes on), or, with ``host``, for the host itself, which reads them next."""
        pending = self.pending
        if pending is None:
            return
        if host and not isinstance(pending, threading.Event):
            pending.synchronize()
        else:
            pending.wait()
        self.pending = None
        native.publish(self, create=False)  # on the fast path again (if managed still)

    def __repr__(self) -> str:
        return f"<Placement #{self.uid} {self.nbytes} B on {self.tier}>"
