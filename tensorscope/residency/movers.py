"""Byte moves between tiers for one device (the manager decides, these move)."""

from __future__ import annotations

import time
import warnings

import torch

from tensorscope._torch import cuda_event, new_storage, no_dispatch
from tensorscope.errors import ResidencyError, ResidencyWarning
from tensorscope.residency.disk import DiskTier
from tensorscope.residency.mapping import DiskRegion
from tensorscope.residency.placement import Placement
from tensorscope.residency.tiers import DeviceTier, HostTier, TierName, empty_storage, swap_in

__all__ = ["Movers", "truncated_error"]


def truncated_error(placement: Placement) -> ResidencyError:
    return ResidencyError(
        f"tensorscope.residency: the offload file of a {placement.nbytes}-byte tensor was "
        "truncated or overwritten behind the manager's back; its data cannot be read. Nothing "
        "touched the mapping (that would have crashed the process). Remove the model's "
        "management (handle.remove(): the lost bytes read as zeros) or reload it."
    )


class Movers:
    """Byte moves between tiers for one device; each returns the seconds it took.

    On a CPU device the disk region becomes the storage's memory at the first demotion (a copy,
    then a data-pointer swap); later moves only drop or map pages (see tiers.py's NOTE). On CUDA
    every move copies and swaps (device memory goes back to the caching allocator).
    """

    def __init__(
        self,
        device: DeviceTier,
        host: HostTier | None,
        disk: DiskTier,
        copy_stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.device = device
        self.host = host
        self.disk = disk
        self.copy_stream = copy_stream  # CUDA prefetches run here, overlapping compute
        self.migrated_bytes = 0  # heap bytes freed by first demotions (see release_free_heap)

    # ------------------------------------------------------------------------------ demote
    def demote(self, placement: Placement, target: TierName) -> float:
        with no_dispatch():  # the manager's own copies must not re-enter the interceptor
            return self._demote(placement, target)

    def _demote(self, placement: Placement, target: TierName) -> float:
        start = time.perf_counter()
        placement.wait()
        source = placement.tier
        if target == source:
            return 0.0
        if self.device.is_cpu:
            self._to_disk_cpu(placement)
        elif target == "host":
            if self.host is None:
                raise ResidencyError("tensorscope.residency: no host tier on this device")
            host = self.host.allocate(placement.nbytes)
            host.copy_(placement.storage)
            self._release_device(placement)
            placement.host = host
        else:
            region = placement.region or self.disk.allocate(placement.nbytes)
            if not region.readonly:  # a checkpoint's region already holds these bytes
                view = region.storage()
                pinned = placement.host
                view.copy_(pinned if source == "host" and pinned is not None else placement.storage)
            if source == "device":
                self._release_device(placement)
            placement.host = None
            placement.region = region
        placement.tier = target
        return time.perf_counter() - start

    def _to_disk_cpu(self, placement: Placement) -> None:
        region = placement.region or self._move_into_file(placement)
        # Dropped here, synchronously: RSS must fall when the budget says so, and a queued drop
        # would delay the prefetches behind it (measured: both got worse).
        region.drop()

    def _move_into_file(self, placement: Placement) -> DiskRegion:
        """CPU device: copy a storage's heap bytes into a new disk region and make the mapping
        its memory (the heap memory goes back to the allocator). Raises before changing
        anything if the disk is full."""
        storage = placement.storage
        region = self.disk.store(storage.data_ptr(), placement.nbytes)
        mapped = region.storage()
        swap_in(storage, mapped)  # the storage's memory is now the mapped file
        placement.region = region
        self.migrated_bytes += placement.nbytes
        return region

    def relocate(self, placement: Placement) -> None:
        """Copy on first write: a checkpoint-backed placement gets its own offload region
        before anything writes to it (the checkpoint is never modified). On a CPU device its
        memory becomes the new region (mapped if it was resident); on CUDA the device copy is
        the data, and the next demotion writes it to a region of its own."""
        old = placement.region
        if old is None or not old.readonly:
            return
        with no_dispatch():
            region = None
            if self.device.is_cpu:
                region = self.disk.store(old.address, placement.nbytes)  # raises if disk full
                swap_in(placement.storage, region.storage())
                if placement.tier == "device":
                    region.populate(write=True)
            placement.region = region
            self.disk.release(old, reusable=False)

    def back_with_file(self, placement: Placement) -> None:
        """CPU device: give a device-resident placement file-backed memory now, mapped (it
        stays resident). Later moves of it then only map and drop pages."""
        if not self.device.is_cpu or placement.region is not None or placement.tier != "device":
            return
        with no_dispatch():
            region = self._move_into_file(placement)
            region.populate(write=placement.written)

    def _release_device(self, placement: Placement) -> None:
        if self.device.device.type == "cuda":
            torch.cuda.current_stream(self.device.device).synchronize()
        swap_in(placement.storage, empty_storage(self.device.device))

    # ----------------------------------------------------------------------------- promote
    def check_readable(self, placement: Placement) -> None:
        """Raise before touching a placement whose file was truncated (see disk.py's NOTE)."""
        region = placement.region
        if region is None:
            if placement.tier == "disk":
                raise truncated_error(placement)
            return
        if not region.intact():
            raise truncated_error(placement)

    def promote(self, placement: Placement, background: bool = False) -> float:
        """Bring the bytes to the device (``check_readable`` first: this must not fail)."""
        with no_dispatch():
            return self._promote(placement, background)

    def _promote(self, placement: Placement, background: bool) -> float:
        start = time.perf_counter()
        placement.wait()  # a drop of its pages may still be queued
        if placement.tier == "device":
            return 0.0
        if self.device.is_cpu:
            region = placement.region
            assert region is not None  # a CPU placement off the device always has a region
            if not region.populate(write=placement.written):
                raise truncated_error(placement)
        else:
            if placement.tier == "host" and placement.host is not None:
                source = placement.host
            else:
                assert placement.region is not None
                source = placement.region.storage()
            stream = self.copy_stream if background else None
            if stream is None:
                fresh = self.device.allocate(placement.nbytes)
                fresh.copy_(source)
            else:
                # The copy is queued on the side stream; ops wait on its event (Placement.wait).
                stream.wait_stream(torch.cuda.current_stream(self.device.device))
                with torch.cuda.stream(stream):
                    fresh = self.device.allocate(placement.nbytes)
                    fresh.copy_(source, non_blocking=True)
                    event = cuda_event()
                    event.record(stream)
                placement.pending = event
            swap_in(placement.storage, fresh)
            placement.host = None
        placement.tier = "device"
        return time.perf_counter() - start

    def materialize(self, placement: Placement) -> None:
        """Give the storage ordinary device memory again (used when a tensor stops being
        managed), so nothing keeps pointing into an offload file."""
        with no_dispatch():
            self._materialize(placement)

    def _materialize(self, placement: Placement) -> None:
        if self.device.is_cpu:
            region = placement.region
            if region is not None:
                if region.intact():
                    fresh = new_storage(placement.nbytes)
                    fresh.copy_(placement.storage)
                else:  # the file was truncated behind our back: the bytes are gone
                    fresh = torch.zeros(placement.nbytes, dtype=torch.uint8).untyped_storage()
                    warnings.warn(
                        f"tensorscope.residency: the offload file of a {placement.nbytes}-byte "
                        "tensor was truncated; its data is lost and reads as zeros now.",
                        ResidencyWarning,
                        stacklevel=4,
                    )
                swap_in(placement.storage, fresh)
                self.disk.release(region, reusable=False)
                placement.region = None
        else:
            self.promote(placement)
        placement.tier = "device"
