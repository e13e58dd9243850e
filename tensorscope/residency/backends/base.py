"""The device backend interface: the policy every device shares, over a few primitives.

tinygrad's ``Allocator`` shape (``device.py``): ``Backend``'s public methods hold the policy --
host memory for copies from the pinned pool with a pageable fallback, non-blocking copies only
from or to pinned memory, an allocator's refusal turned into ``Refused``, device memory given
back only through ``release`` -- and each backend writes only its primitives: ``_allocate``
(device memory), ``_pin`` (pinned host memory), ``_copy`` (one copy, on the compute stream or
a copy stream) and ``_retire`` (device memory given back). The residency movers and fit's
offload stores call the public methods; nothing above this package asks which device it is.

# NOTE [the copy rules]
# What every caller keeps, so that the CUDA backend is correct, and what the strict backend
# (strict.py) checks on the CPU:
# 1. Device memory comes from ``allocate``, on the calling thread's current (compute) stream.
# 2. A copy on a copy stream first waits for the compute stream: what was queued there (the
#    kernel that wrote the source, the last use of a reused block) comes first. One copy
#    stream per direction: a prefetch is never queued behind a demotion.
# 3. A copy returns a ``Pending``; its destination holds the bytes only once it is waited:
#    ``wait()`` by a consumer on the device (the current stream waits for the copy's event,
#    the host goes on), ``synchronize()`` by a consumer on the host (the CPU reads the bytes:
#    a disk write of a host buffer). A copy on the compute stream, and a copy from or to
#    pageable memory (blocking), is done for everything after it: ``DONE``.
# 4. Device memory leaves a storage only through ``release``: memory a copy still reads or
#    writes is not reused before the copy is done (CUDA: ``record_stream`` onto the copy's
#    stream). A copy's device memory stays with the storage it was given until the copy is
#    waited: memory for a promotion is swapped into the placement first, then copied into.
# 5. Host memory a copy reads or writes lives as long as its ``Pending`` (on CUDA torch's host
#    allocator also records the copy's event on pinned blocks).
# 6. Non-blocking copies only from or to pinned memory: pageable memory is copied blocking,
#    and a background copy from pageable memory (a disk mapping) is staged through the pinned
#    pool first when it has room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from tensorscope._torch import new_storage, no_dispatch, swap_data_ptr

if TYPE_CHECKING:
    from tensorscope.residency.backends.pinned import PinnedPool
    from tensorscope.residency.tiers import TierName

__all__ = ["DONE", "Backend", "Pending", "Refused", "first_line"]

CPU = torch.device("cpu")


class Pending(Protocol):
    """A copy in flight (NOTE [the copy rules], 3)."""

    def wait(self) -> None:
        """A consumer on the device: ops queued after this on the current stream see the bytes."""

    def synchronize(self) -> None:
        """A consumer on the host: returns once the bytes are there."""


class _Done:
    """A copy that is complete for everything after it."""

    __slots__ = ()

    def wait(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "DONE"


DONE: Pending = _Done()


class Refused(RuntimeError):
    """An allocator could not serve a move (device memory, or host memory for a copy)."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Backend:
    """What differs per device (see the module docstring); ``backend_for(device)`` picks one."""

    name: ClassVar[str]
    # The device's memory can be a disk region's mapping: moves map and drop pages, no copies.
    maps_files: ClassVar[bool]
    # The device's memory is the process's C heap (giving freed heap back lowers what it holds).
    heap_device: ClassVar[bool]
    # A host tier between the device and the disk (pinned host memory).
    host_tier: ClassVar[bool]

    def __init__(self, device: torch.device, pool: PinnedPool | None) -> None:
        self.device = device
        self.pool = pool  # pinned host memory for copies (None: no host tier)

    @property
    def tiers(self) -> tuple[TierName, ...]:
        """The tiers this device has, top to bottom."""
        return ("device", "host", "disk") if self.host_tier else ("device", "disk")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.device}>"

    # ------------------------------------------------------------------------------ memory
    def allocate(self, nbytes: int, *, seen: bool = False) -> torch.UntypedStorage:
        """Device memory (rule 1); ``Refused`` when the device's allocator cannot serve it.
        ``seen``: made by a tensor op, which a recording sees (``ts.record``, fit's measured
        step), as any tensor the step makes; else made unseen (the residency manager's own)."""
        try:
            return self._allocate(nbytes, seen)
        except (torch.OutOfMemoryError, MemoryError) as exc:
            raise Refused(f"device memory: {first_line(exc)}") from exc

    def staging(self, nbytes: int) -> torch.UntypedStorage:
        """Host memory to copy into or out of: pinned from the pool while it has room, else
        pageable (the pool counts the fallback, ``report()`` shows it); ``Refused`` when not
        even pageable memory can be had."""
        pool = self.pool
        if pool is not None and nbytes:
            pinned = pool.take(nbytes)
            if pinned is not None:
                return pinned
        try:
            return new_storage(nbytes, CPU)
        except (RuntimeError, MemoryError) as exc:
            raise Refused(f"host memory: {first_line(exc)}") from exc

    def release(self, storage: torch.UntypedStorage) -> None:
        """Give ``storage``'s device memory back; the storage keeps its identity, with no
        bytes. Memory a pending copy still uses is not reused before the copy is done."""
        old = new_storage(0, self.device)
        swap_data_ptr(storage, old)  # ``old`` holds the memory now
        self._retire(old, storage)

    def pinned(self, host: torch.UntypedStorage) -> bool:
        """Whether ``host`` is pinned memory of this backend's pool."""
        pool = self.pool
        return pool is not None and pool.holds(host)

    # ------------------------------------------------------------------------------ copies
    def copy_in(
        self, dst: torch.UntypedStorage, src: torch.UntypedStorage, *, background: bool = False
    ) -> Pending:
        """Copy host ``src`` into device ``dst``: on the copy stream in when ``background``
        (wait for the ``Pending`` before reading ``dst``), else on the compute stream."""
        nbytes = src.nbytes()
        if not nbytes:
            return DONE
        pinned = self.pinned(src)
        if background and not pinned and self.pool is not None:
            staged = self.pool.take(nbytes)  # rule 6: a disk mapping is staged first
            if staged is not None:
                with no_dispatch():
                    staged.copy_(src)
                src, pinned = staged, True
        return self._copy(dst, src, to_device=True, background=background, pinned=pinned)

    def copy_out(self, dst: torch.UntypedStorage, src: torch.UntypedStorage) -> Pending:
        """Copy device ``src`` into host ``dst`` on the copy stream out (``synchronize()``
        before the host reads ``dst``; ``wait()`` orders later copies on the compute stream)."""
        if not src.nbytes():
            return DONE
        return self._copy(dst, src, to_device=False, background=True, pinned=self.pinned(dst))

    def claim(self, storage: torch.UntypedStorage) -> None:
        """The current stream uses ``storage`` from now on: device memory allocated on another
        thread's stream (fit's reader thread) is not reused before this stream is done."""
        return None

    def synchronize(self) -> None:
        """The host waits for everything queued on the device (measurements only)."""
        return None

    def staging_report(self) -> tuple[int | None, int | None, int, str | None]:
        """(pinned bytes live, the pool's limit, copies through pageable memory instead, the
        latest reason); Nones and 0 without a pinned pool."""
        pool = self.pool
        if pool is None:
            return None, None, 0, None
        return pool.live_bytes, pool.limit, pool.fallbacks, pool.why

    def allocator_bytes(self) -> tuple[int | None, int | None]:
        """(reserved, allocated) of the device's caching allocator; Nones where there is none."""
        return None, None

    def reset_allocator_peaks(self) -> None:
        """Start the caching allocator's peaks afresh (nothing where there is none)."""
        return None

    def allocator_peaks(self) -> tuple[int | None, int | None]:
        """(reserved, allocated) at their highest since :meth:`reset_allocator_peaks`; Nones
        where there is no caching allocator."""
        return None, None

    # -------------------------------------------------------------------------- primitives
    def _allocate(self, nbytes: int, seen: bool) -> torch.UntypedStorage:
        if seen:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
        return new_storage(nbytes, self.device)

    def _copy(
        self,
        dst: torch.UntypedStorage,
        src: torch.UntypedStorage,
        *,
        to_device: bool,
        background: bool,
        pinned: bool,
    ) -> Pending:
        raise NotImplementedError

    def _retire(self, old: torch.UntypedStorage, left: torch.UntypedStorage) -> None:
        """``old`` holds the device memory that left ``left`` (``release``); drop it when it
        may go (CUDA: at once, its copies ``record_stream``-ed it)."""
        return None
