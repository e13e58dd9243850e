"""Byte moves between tiers for one device (the manager decides, these move).

What differs per device is the backend's (``residency/backends``): a backend whose device
memory can be a disk region's mapping (the CPU) moves by mapping and dropping pages; any other
(CUDA, and the strict test backend) moves by copies, keeping base.py's NOTE [the copy rules].
"""

from __future__ import annotations

import time

import torch

from tensorscope._torch import no_dispatch, tensor_over
from tensorscope._units import format_bytes
from tensorscope.errors import ResidencyError
from tensorscope.residency.backends import DONE, Backend, Refused
from tensorscope.residency.disk import DiskTier
from tensorscope.residency.mapping import DiskRegion
from tensorscope.residency.placement import Placement
from tensorscope.residency.tiers import TierName, move_into_file, swap_in

__all__ = ["Movers", "describe", "lost_error", "lost_on_remove"]


def describe(placement: Placement) -> str:
    """A managed tensor's name for messages: the parameter or buffer name ``ts.manage()`` gave
    it, else its size."""
    role = placement.role
    if isinstance(role, tuple) and len(role) == 2 and isinstance(role[1], str):
        return role[1]
    return f"a {format_bytes(placement.nbytes)} tensor"


def lost_error(placement: Placement, reason: str) -> ResidencyError:
    return ResidencyError(
        f"tensorscope.residency: the bytes of {describe(placement)} "
        f"({format_bytes(placement.nbytes)}) cannot be read: {reason}. Nothing touched them "
        "(that could have crashed the process); the other tensors work on. Restore the file "
        "(the bytes ts.manage() loaded) and retry, or give the tensor a new value "
        "(module.load_state_dict(...), or assign a new nn.Parameter)."
    )


def lost_on_remove(lost: list[tuple[Placement, str]]) -> ResidencyError:
    shown = "; ".join(f"{describe(p)}: {why}" for p, why in lost[:10])
    more = f" and {len(lost) - 10} more" if len(lost) > 10 else ""
    return ResidencyError(
        f"tensorscope.residency: remove() gave back every tensor but {len(lost)} whose bytes "
        f"are lost ({shown}{more}). Those stay managed and raise ResidencyError when used; "
        "nothing was replaced by zeros. Restore the file (the bytes ts.manage() loaded) and "
        "call remove() again, or give them new values (module.load_state_dict(...), or "
        "assign new nn.Parameters) and call remove() again."
    )


class Movers:
    """Byte moves between tiers for one device; each returns the seconds it took.

    When the device's memory can be a file mapping (the CPU) the disk region becomes the
    storage's memory at the first demotion (a copy, then a data-pointer swap); later moves only
    drop or map pages (see disk.py's NOTE [CPU and CUDA]). Otherwise every move copies through
    the backend and gives the device memory back (``Backend.release``).
    """

    def __init__(self, backend: Backend, disk: DiskTier) -> None:
        self.backend = backend
        self.maps_files = backend.maps_files
        self.disk = disk
        self.migrated_bytes = 0  # heap bytes freed by first demotions (see release_free_heap)

    # ------------------------------------------------------------------------------ demote
    def demote(self, placement: Placement, target: TierName) -> float:
        with no_dispatch():  # the manager's own copies must not re-enter the interceptor
            return self._demote(placement, target)

    def _refused(self, placement: Placement, target: str, exc: BaseException) -> ResidencyError:
        """An allocator could not serve a move (API §12): the data stays where it was."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return ResidencyError(
            f"tensorscope.residency: moving {describe(placement)} "
            f"({format_bytes(placement.nbytes)}) from the {placement.tier} tier to the {target} "
            f"tier failed: the allocator could not serve it ({first}). It stays on the "
            f"{placement.tier} tier, unchanged. Free memory there (tensors outside the budget, "
            "torch.cuda.empty_cache()) or lower the budget (ts.residency.configure(budget=...))."
        )

    def _demote(self, placement: Placement, target: TierName) -> float:
        start = time.perf_counter()
        source = placement.tier
        placement.wait(host=source == "host")  # a host buffer is read on the CPU below
        if target == source:
            return 0.0
        if self.maps_files:
            self._to_disk_cpu(placement)
        elif target == "host":
            self._to_host(placement)
        else:
            self._to_disk(placement, source)
        placement.tier = target
        return time.perf_counter() - start

    def _to_host(self, placement: Placement) -> None:
        """Device to host: an asynchronous copy into pinned memory (pageable when the pool
        cannot give it); the device memory goes back at once (rule 4 keeps it for the copy)."""
        if "host" not in self.backend.tiers:
            raise ResidencyError("tensorscope.residency: no host tier on this device")
        try:
            host = self.backend.staging(placement.nbytes)
        except Refused as exc:
            raise self._refused(placement, "host", exc) from exc
        pending = self.backend.copy_out(host, placement.storage)
        self.backend.release(placement.storage)
        placement.host = host
        placement.pending = None if pending is DONE else pending  # promote()/_demote() wait

    def _to_disk(self, placement: Placement, source: TierName) -> None:
        """To the disk tier by a copy (the host waited for a host buffer's copy above)."""
        region = placement.region or self.disk.allocate(placement.nbytes)  # raises: disk full
        if not region.readonly:  # a checkpoint's region already holds these bytes
            view = region.storage()
            pinned = placement.host
            if source == "host" and pinned is not None:
                view.copy_(pinned)
            else:
                self.backend.copy_out(view, placement.storage).synchronize()
        if source == "device":
            self.backend.release(placement.storage)
        placement.host = None
        placement.region = region

    def _to_disk_cpu(self, placement: Placement) -> None:
        region = placement.region or self._move_into_file(placement)
        # Dropped here, synchronously: RSS must fall when the budget says so, and a queued drop
        # would delay the prefetches behind it (measured: both got worse).
        region.drop()

    def _move_into_file(self, placement: Placement) -> DiskRegion:
        """CPU device: copy a storage's heap bytes into a new disk region and make the mapping
        its memory (the heap memory goes back to the allocator). Raises before changing
        anything if the disk is full."""
        region = move_into_file(self.disk, placement.storage)
        placement.region = region
        self.migrated_bytes += placement.nbytes
        return region

    def relocate(self, placement: Placement) -> None:
        """Copy on first write: a checkpoint-backed placement gets its own offload region
        before anything writes to it (the checkpoint is never modified). Where the region is
        the memory (the CPU) its memory becomes the new region (mapped if it was resident);
        elsewhere the device copy is the data, and the next demotion writes it to a region of
        its own."""
        old = placement.region
        if old is None or not old.readonly:
            return
        with no_dispatch():
            region = None
            if self.maps_files:
                region = self.disk.store(old.address, placement.nbytes)  # raises if disk full
                swap_in(placement.storage, region.storage())
                if placement.tier == "device":
                    region.populate(write=True)
            placement.region = region
            self.disk.release(old, reusable=False)

    def back_with_file(self, placement: Placement) -> None:
        """CPU device: give a device-resident placement file-backed memory now, mapped (it
        stays resident). Later moves of it then only map and drop pages."""
        if not self.maps_files or placement.region is not None or placement.tier != "device":
            return
        with no_dispatch():
            region = self._move_into_file(placement)
            region.populate(write=placement.written)

    # ----------------------------------------------------------------------------- promote
    def damage(self, placement: Placement) -> str | None:
        """Why a placement's bytes cannot be read (its file truncated or changed behind the
        manager's back where they lie), or None. Where moves copy, only the disk tier reads
        the file."""
        region = placement.region
        if region is None:
            return "its data is gone" if placement.tier == "disk" else None
        if not self.maps_files and placement.tier != "disk":
            return None
        return region.damage()

    def check_readable(self, placement: Placement) -> None:
        """Raise before touching a placement whose bytes are lost (see mapping.py)."""
        reason = self.damage(placement)
        if reason is not None:
            raise lost_error(placement, reason)

    def lost(self, placements: list[Placement]) -> list[tuple[Placement, str]]:
        """The placements among ``placements`` whose bytes are lost, with why: each file is
        checked once (one system call on the fast path)."""
        found: list[tuple[Placement, str]] = []
        checked: dict[int, bool] = {}
        for placement in placements:
            region = placement.region
            if region is None:
                if placement.tier == "disk":
                    found.append((placement, "its data is gone"))
                continue
            if not self.maps_files and placement.tier != "disk":
                continue
            file = region.file
            bad = checked.get(id(file))
            if bad is None:
                bad = checked[id(file)] = file.refresh()
            if bad:
                reason = file.lost_reason(region.offset, region.nbytes)
                if reason is not None:
                    found.append((placement, reason))
        return found

    def replace_lost(self, placement: Placement) -> None:
        """Give a placement whose bytes are lost new, writable memory on the device (an op is
        about to overwrite all of it: ``copy_``, ``fill_``...); the old region is let go."""
        with no_dispatch():
            old = placement.region
            if self.maps_files:
                region = self.disk.allocate(placement.nbytes)  # raises if the disk is full
                swap_in(placement.storage, region.storage())
                region.populate(write=True)
                placement.region = region
            else:
                swap_in(placement.storage, self._device_memory(placement))
                placement.region = None
                placement.host = None
            if old is not None:
                self.disk.release(old, reusable=False)
            placement.tier = "device"
            placement.written = True

    def _device_memory(self, placement: Placement) -> torch.UntypedStorage:
        try:
            return self.backend.allocate(placement.nbytes)
        except Refused as exc:
            raise self._refused(placement, "device", exc) from exc

    def promote(self, placement: Placement, background: bool = False) -> float:
        """Bring the bytes to the device (``check_readable`` first: this must not fail, but for
        a device allocator that cannot serve it: ``ResidencyError``, nothing changed).
        ``background``: the copy runs on the backend's copy stream and ``placement.pending``
        is what its users wait for (``Placement.wait``)."""
        with no_dispatch():
            return self._promote(placement, background)

    def _promote(self, placement: Placement, background: bool) -> float:
        start = time.perf_counter()
        placement.wait()  # a drop of its pages may still be queued; a demotion's copy
        if placement.tier == "device":
            return 0.0
        if self.maps_files:
            region = placement.region
            assert region is not None  # a CPU placement off the device always has a region
            if not region.populate(write=placement.written):
                raise lost_error(placement, region.damage() or "the kernel refused to map it")
        else:
            if placement.tier == "host" and placement.host is not None:
                source = placement.host
            else:
                assert placement.region is not None
                source = placement.region.storage()
            # Rule 4 (base.py): the memory is the placement's first, then copied into.
            swap_in(placement.storage, self._device_memory(placement))
            try:
                pending = self.backend.copy_in(placement.storage, source, background=background)
            except BaseException:
                self.backend.release(placement.storage)
                raise
            placement.pending = None if pending is DONE else pending
            placement.host = None
        placement.tier = "device"
        return time.perf_counter() - start

    def materialize(self, placement: Placement, lost: str = "keep") -> str | None:
        """Give the storage ordinary device memory again (used when a tensor stops being
        managed), so nothing keeps pointing into an offload file. Returns why it could not,
        for a placement whose bytes are lost: then nothing changed (``lost="keep"``), or, with
        ``lost="poison"`` (``ts.residency.reset()``), its memory is ordinary memory filled
        with 0xFF bytes (NaN in every float dtype, -1 in signed integers), never zeros."""
        with no_dispatch():
            return self._materialize(placement, lost)

    def _materialize(self, placement: Placement, lost: str) -> str | None:
        reason = self.damage(placement)
        if reason is not None and lost == "keep":
            return reason
        if self.maps_files or reason is not None:
            region = placement.region
            if region is not None or reason is not None:
                fresh = self._device_memory(placement)
                if reason is None:
                    fresh.copy_(placement.storage)  # both are the CPU's memory
                else:
                    tensor_over(fresh, torch.uint8, (placement.nbytes,)).fill_(0xFF)
                swap_in(placement.storage, fresh)
                if region is not None:
                    self.disk.release(region, reusable=False)
                placement.region = None
                placement.host = None
        else:
            self.promote(placement)
        placement.tier = "device"
        return reason
