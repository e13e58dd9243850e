"""Where bytes live: tier names, a storage's memory exchanged in place, the C heap's free memory.

The manager decides which tier a placement should be on; the device backend
(``residency/backends``) allocates and copies its bytes, the disk tier is ``disk.py``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import TYPE_CHECKING, Literal

import torch

from tensorscope._torch import new_storage, storage_door_missing, swap_data_ptr
from tensorscope.errors import ResidencyError

if TYPE_CHECKING:
    from tensorscope.residency.disk import DiskTier
    from tensorscope.residency.mapping import DiskRegion

__all__ = [
    "TIER_ORDER",
    "TierName",
    "empty_storage",
    "free_heap_bytes",
    "release_free_heap",
    "swap_in",
]

TierName = Literal["device", "host", "disk"]
TIER_ORDER: tuple[TierName, ...] = ("device", "host", "disk")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_malloc_trim = getattr(_libc, "malloc_trim", None)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


_mallinfo2 = getattr(_libc, "mallinfo2", None)
if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2


def free_heap_bytes() -> int:
    """Bytes glibc's heap holds free (kept for reuse, still resident); 0 if unknown."""
    if _mallinfo2 is None:
        return 0
    return int(_mallinfo2().fordblks)


def release_free_heap() -> None:
    """Give the C heap's free memory back to the OS (glibc's ``malloc_trim``; else no-op).

    The first demotion of a CPU tensor frees its original heap memory, and each iteration's
    activations leave free heap behind, all of which glibc keeps resident for reuse: without
    trimming, RSS would not fall when a model's weights move to the disk tier.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def empty_storage(device: torch.device) -> torch.UntypedStorage:
    """A 0-byte storage on ``device`` to swap data pointers with."""
    return new_storage(0, device)


def swap_in(storage: torch.UntypedStorage, source: torch.UntypedStorage) -> None:
    """Give ``storage`` the memory of ``source`` (and ``source`` whatever ``storage`` had).

    Every tensor sharing ``storage`` sees the new memory; the old one now belongs to
    ``source`` and is released when ``source`` is dropped.
    """
    swap_data_ptr(storage, source)


def move_into_file(disk: DiskTier, storage: torch.UntypedStorage) -> DiskRegion:
    """CPU device: write ``storage``'s bytes to a new region of ``disk`` and make the region's
    mapping its memory (the same storage object: every tensor on it follows; the heap memory
    goes back to the allocator). Raises before changing anything if the disk is full, or if
    no storage's memory can be exchanged here (_torch.py's NOTE [the storage door])."""
    why = storage_door_missing()
    if why is not None:
        raise ResidencyError(f"tensorscope.residency: nothing can move between tiers: {why}.")
    region = disk.store(storage.data_ptr(), storage.nbytes())
    swap_in(storage, region.storage())
    return region
