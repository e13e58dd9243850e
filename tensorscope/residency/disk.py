"""The disk tier: regions carved from a few shared, mapped, unnamed offload files.

# NOTE [arenas: a few files, many regions]
# Each offload file (an *arena*) is an unnamed file (``O_TMPFILE``, or a name unlinked at once)
# under ``offload_dir``, mapped shared once with ``mmap(2)`` over a large virtual range; regions
# (one per managed storage) are carved from it by a first-fit allocator. So the process holds one
# descriptor per arena, however many tensors are managed: a 400-parameter model with Adam state
# used to need 2 descriptors per storage and failed under ``ulimit -n 1024``. The file grows as
# regions are allocated (its size, not the mapping, bounds what may be touched), so a disk limit
# (``RLIMIT_FSIZE``, a full disk) fails an allocation or a write, never a store into the mapping.
# Regions of 2 MiB or more start at 2 MiB offsets: written with ``pwrite`` the file gets large
# page-cache folios, and promoting maps 2 MiB per page-table entry (docs/design.md §4).
#
# NOTE [truncation behind our back]
# A page of a shared file mapping beyond the file's end raises SIGBUS when touched, which would
# kill the process. After its data area each arena keeps a canary page of random bytes;
# ``intact()`` reads it with ``pread`` (never through the mapping): a file truncated (or
# truncated and re-extended, which reads as zeros) fails the check. The residency manager checks
# the arenas of an op's operands before the op and raises ``ResidencyError`` instead of touching
# the mapping. Reads that bypass the manager (another thread that never intercepted) cannot be
# protected this way.
#
# NOTE [CPU and CUDA]
# On a CPU device the mapping *is* a managed storage's memory once demoted: its data pointer is
# swapped to the region (``UntypedStorage._swap_data_ptr_``), so identity, views and autograd's
# saved tensors are untouched. Demoting drops the pages (``MADV_DONTNEED``: RSS falls, the bytes
# stay in the page cache and the file); promoting maps them again (``MADV_POPULATE_READ`` or
# ``_WRITE``: no copy, no allocation). With a CUDA device regions are copy targets (reserved with
# ``posix_fallocate`` first, so a full disk fails the reservation, never the copy).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import shutil
import tempfile
import weakref
from bisect import bisect_left
from collections.abc import Callable

import torch

from tensorscope._torch import ORIGINAL_FROMBUFFER, new_storage
from tensorscope._units import format_bytes
from tensorscope.errors import ResidencyError

__all__ = ["Arena", "DiskRegion", "DiskTier", "madvise"]

PAGE = mmap.PAGESIZE
LARGE = 2 << 20  # regions this large start at 2 MiB offsets (large folios, 2 MiB mappings)
ARENA_SPAN = 8 << 30  # virtual bytes mapped per arena (the file grows inside it)
_WRITE_CHUNK = 64 << 20  # bytes per pwrite call
_POOL_MIN_BYTES = 64 << 20  # pooled regions may always hold this much (see DiskTier.release)
_CANARY_BYTES = 16
_MADV_DONTNEED = 4
_MADV_REMOVE = 9
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


def _round_up(value: int, granule: int) -> int:
    return (value + granule - 1) // granule * granule


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)``; returns 0 or the errno. ctypes releases the GIL for the call, so a
    prefetch thread overlaps with compute."""
    if length == 0:
        return 0
    if _libc.madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


class Arena:
    """One offload file, mapped whole, from which regions are carved (see the NOTE above)."""

    def __init__(self, fd: int, span: int) -> None:
        self.fd = fd
        self.span = span
        address = _libc.mmap(None, span, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        self.address: int = address
        # The bytes of the whole span as a buffer: storages are made from slices of it.
        self._buffer = memoryview((ctypes.c_char * span).from_address(address)).cast("B")
        self._free: list[tuple[int, int]] = [(0, span - PAGE)]  # (offset, length), sorted
        self.high = 0  # end of the data area in the file
        self.live = 0  # regions handed out and not given back
        self._canary = os.urandom(_CANARY_BYTES)
        self._grow(0)

    # --------------------------------------------------------------------------- allocation
    def carve(self, nbytes: int) -> tuple[int, int] | None:
        """Offset and length of a free range for ``nbytes``, or None if the span is full."""
        granule = LARGE if nbytes >= LARGE else PAGE
        length = max(PAGE, _round_up(nbytes, PAGE))
        for index, (start, size) in enumerate(self._free):
            offset = _round_up(start, granule)
            if offset + length <= start + size:
                pieces = []
                if offset > start:
                    pieces.append((start, offset - start))
                if offset + length < start + size:
                    pieces.append((offset + length, start + size - offset - length))
                self._free[index : index + 1] = pieces
                self.live += 1
                return offset, length
        return None

    def give_back(self, offset: int, length: int) -> None:
        """Return a range to the free list (merging neighbours)."""
        self.live -= 1
        free = self._free
        index = bisect_left(free, (offset, 0))
        free.insert(index, (offset, length))
        if index + 1 < len(free) and offset + length == free[index + 1][0]:
            free[index] = (offset, length + free[index + 1][1])
            del free[index + 1]
        if index > 0 and free[index - 1][0] + free[index - 1][1] == free[index][0]:
            free[index - 1] = (free[index - 1][0], free[index - 1][1] + free[index][1])
            del free[index]

    def ensure_file_covers(self, end: int) -> None:
        """Grow the file so that ``[0, end)`` lies inside it; raises ``OSError`` if it cannot."""
        if end > self.high:
            self._grow(end)

    def _grow(self, end: int) -> None:
        os.ftruncate(self.fd, end + PAGE)  # the data area, then the canary page
        try:
            written = os.pwrite(self.fd, self._canary, end)
        except OSError:
            os.ftruncate(self.fd, self.high + PAGE)
            raise
        if written != _CANARY_BYTES:
            os.ftruncate(self.fd, self.high + PAGE)
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        self.high = end

    # ---------------------------------------------------------------------------- checks/io
    def intact(self) -> bool:
        """Whether the file still holds the canary after its data area (never truncated)."""
        try:
            return os.pread(self.fd, _CANARY_BYTES, self.high) == self._canary
        except OSError:
            return False

    def storage(self, offset: int, nbytes: int) -> torch.UntypedStorage:
        """A storage whose memory is ``nbytes`` of the mapping at ``offset``."""
        if nbytes == 0:  # frombuffer refuses empty buffers; there are no bytes to map
            return new_storage(0)
        view = self._buffer[offset : offset + nbytes]
        return ORIGINAL_FROMBUFFER(view, dtype=torch.uint8).untyped_storage()

    def close(self) -> None:
        """Unmap and close, unless a region is still in use (then the mapping stays)."""
        if self.live == 0 and self.fd >= 0:
            self._buffer.release()
            _libc.munmap(self.address, self.span)
            os.close(self.fd)
            self.fd = -1


class DiskRegion:
    """One storage's bytes in an arena."""

    __slots__ = ("__weakref__", "address", "arena", "length", "nbytes", "offset")

    def __init__(self, arena: Arena, offset: int, length: int, nbytes: int) -> None:
        self.arena = arena
        self.offset = offset
        self.length = length
        self.nbytes = nbytes
        self.address = arena.address + offset

    def storage(self) -> torch.UntypedStorage:
        """A storage whose memory is this region."""
        return self.arena.storage(self.offset, self.nbytes)

    def write(self, address: int) -> None:
        """Write the ``nbytes`` at ``address`` into the file (``pwrite``, not the mapping)."""
        self.arena.ensure_file_covers(self.offset + self.length)
        if self.nbytes == 0:
            return
        source = memoryview((ctypes.c_char * self.nbytes).from_address(address)).cast("B")
        done = 0
        fd = self.arena.fd
        while done < self.nbytes:  # pwrite may write less than asked (a signal, a file limit)
            written = os.pwrite(fd, source[done : done + _WRITE_CHUNK], self.offset + done)
            if written == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += written

    def reserve(self) -> None:
        """Reserve the region's blocks on disk (``posix_fallocate``)."""
        self.arena.ensure_file_covers(self.offset + self.length)
        os.posix_fallocate(self.arena.fd, self.offset, self.length)

    def intact(self) -> bool:
        """Whether the backing file is untouched (not truncated behind the manager's back)."""
        return self.arena.intact()

    def populate(self, write: bool) -> bool:
        """Map the region's pages into the process (read ahead from the page cache or disk).
        False if the kernel refused (a file truncated behind our back)."""
        advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
        return madvise(self.address, self.length, advice) == 0

    def drop(self) -> None:
        """Unmap the region's pages: RSS falls, the bytes stay in the page cache and the file."""
        madvise(self.address, self.length, _MADV_DONTNEED)

    def discard(self) -> None:
        """Drop the region's pages and free its disk blocks (its bytes are not needed). Only
        the part inside the arena's data area: the canary after it must stay."""
        inside = min(self.length, self.arena.high - self.offset)
        if inside > 0 and madvise(self.address, inside, _MADV_REMOVE) != 0:
            self.drop()

    def flush(self) -> None:
        """Write the arena's dirty pages to the file now (``fdatasync``; not the hot path)."""
        if self.arena.fd >= 0:
            os.fdatasync(self.arena.fd)


class DiskTier:
    """Arena files under ``offload_dir`` (default: a private temporary directory removed at exit).

    Example:
        >>> tier = DiskTier(None)
        >>> region = tier.allocate(4096)
        >>> region.nbytes
        4096
        >>> tier.release(region, reusable=False); tier.close()
    """

    name = "disk"

    def __init__(self, directory: str | None) -> None:
        self.private = directory is None
        if directory is None:
            self.directory = tempfile.mkdtemp(prefix="tensorscope-")
            _PRIVATE_DIRS.add(self.directory)
        else:
            self.directory = directory
            try:
                os.makedirs(self.directory, exist_ok=True)
            except OSError as exc:
                raise ResidencyError(
                    f"tensorscope.residency: cannot create offload_dir {self.directory!r}: "
                    f"{exc.strerror}. Pass a directory you can write to, or offload_dir=None "
                    "for a private temporary one."
                ) from exc
        self._finalizer = weakref.finalize(self, _remove_private_dir, self.directory, self.private)
        self.arenas: list[Arena] = []
        # Regions whose storage died, kept for the next storage of the same size (see release).
        self._pool: dict[int, list[DiskRegion]] = {}
        self.pooled_bytes = 0
        self.live_bytes = 0  # bytes of the regions handed out and not released
        self.check_writable()

    def check_writable(self) -> None:
        """Create an arena and write one page: fails now rather than on the first demotion."""
        region = self._region(PAGE)
        try:
            region.write(ctypes.addressof(ctypes.create_string_buffer(PAGE)))
        except OSError as exc:
            raise self._write_error(exc, PAGE) from exc
        finally:
            self.release(region, reusable=False)

    # --------------------------------------------------------------------------- regions
    def allocate(self, nbytes: int) -> DiskRegion:
        """A region of ``nbytes`` reserved on disk (``posix_fallocate``), so that writes through
        its mapping cannot fail later; ``ResidencyError`` if the disk is full."""
        region = self._take_pooled(nbytes)
        if region is not None:
            return region
        region = self._region(nbytes)
        try:
            region.reserve()
        except OSError as exc:
            self.release(region, reusable=False)
            raise self._write_error(exc, region.length) from exc
        return region

    def store(self, address: int, nbytes: int) -> DiskRegion:
        """A region holding a copy of the ``nbytes`` at ``address``, written with ``pwrite``
        (large folios; see the NOTE on arenas). A full disk fails the write: nothing has moved."""
        region = self._take_pooled(nbytes) or self._region(nbytes)
        try:
            region.write(address)
        except OSError as exc:
            self.release(region, reusable=False)
            raise self._write_error(exc, region.length) from exc
        return region

    def _region(self, nbytes: int) -> DiskRegion:
        for arena in self.arenas:
            carved = arena.carve(nbytes)
            if carved is not None:
                break
        else:
            arena = self._new_arena(max(ARENA_SPAN, _round_up(nbytes, LARGE) + LARGE))
            carved = arena.carve(nbytes)
            if carved is None:  # pragma: no cover - a fresh arena fits by construction
                raise ResidencyError("tensorscope.residency: internal error: arena too small")
        offset, length = carved
        self.live_bytes += length
        return DiskRegion(arena, offset, length, nbytes)

    def release(self, region: DiskRegion, reusable: bool) -> None:
        """A region no storage uses any more: pooled for the next storage of its size when
        ``reusable`` (its pages dropped from this process first), else given back to its arena
        with its blocks freed.

        Training makes new gradients every step, each the size of the last one: reusing their
        regions replaces new page-cache memory and writes to fresh blocks by an overwrite of
        cached pages. The pool holds at most as many bytes as the live regions (64 MiB at
        least), so it never more than doubles the files' size.
        """
        self.live_bytes -= region.length
        limit = max(_POOL_MIN_BYTES, self.live_bytes)
        if reusable and region.intact() and self.pooled_bytes + region.length <= limit:
            region.drop()
            self._pool.setdefault(region.nbytes, []).append(region)
            self.pooled_bytes += region.length
        else:
            region.discard()
            region.arena.give_back(region.offset, region.length)

    def _take_pooled(self, nbytes: int) -> DiskRegion | None:
        regions = self._pool.get(nbytes)
        if not regions:
            return None
        region = regions.pop()
        self.pooled_bytes -= region.length
        self.live_bytes += region.length
        return region

    def _new_arena(self, span: int) -> Arena:
        fd = self._open()
        try:
            arena = Arena(fd, span)
        except OSError as exc:
            os.close(fd)
            raise self._write_error(exc, PAGE) from exc
        self.arenas.append(arena)
        return arena

    def _open(self) -> int:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        tmpfile = getattr(os, "O_TMPFILE", 0)
        try:
            if tmpfile:
                try:
                    return os.open(self.directory, flags | tmpfile, 0o600)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                        raise
            fd, path = tempfile.mkstemp(dir=self.directory, prefix="ts-", suffix=".bin")
            os.unlink(path)  # no name: nothing can be left behind
            return fd
        except OSError as exc:
            raise ResidencyError(
                f"tensorscope.residency: cannot create an offload file in {self.directory!r}: "
                f"{exc.strerror}. Check that offload_dir exists and is writable."
            ) from exc

    def _write_error(self, exc: OSError, length: int) -> ResidencyError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return ResidencyError(
                f"tensorscope.residency: the disk tier is full: cannot write "
                f"{format_bytes(length)} in {self.directory!r} ({exc.strerror}). Free space, "
                "point offload_dir at a larger disk, or raise the device budget."
            )
        return ResidencyError(
            f"tensorscope.residency: cannot write {format_bytes(length)} in "
            f"{self.directory!r}: {exc.strerror}."
        )

    def flush(self) -> None:
        """``fdatasync`` every arena (dirty pages reach the disk now, not during training)."""
        for arena in self.arenas:
            if arena.fd >= 0:
                os.fdatasync(arena.fd)

    @property
    def descriptors(self) -> int:
        """Open file descriptors this tier holds."""
        return sum(1 for arena in self.arenas if arena.fd >= 0)

    def close(self) -> None:
        """Give pooled regions back, close arenas nothing uses, remove the private directory
        (files have no names, so nothing else is left)."""
        for regions in self._pool.values():
            for region in regions:
                region.arena.give_back(region.offset, region.length)
        self._pool.clear()
        self.pooled_bytes = 0
        for arena in self.arenas:
            arena.close()
        self.arenas = [arena for arena in self.arenas if arena.fd >= 0]
        self._finalizer()


# Private directories made by this process: removed at exit and on SIGTERM/SIGINT.
_PRIVATE_DIRS: set[str] = set()


def _remove_private_dir(
    directory: str, private: bool, _rmtree: Callable[..., None] = shutil.rmtree
) -> None:
    if private:
        _rmtree(directory, ignore_errors=True)
        _PRIVATE_DIRS.discard(directory)


def remove_private_dirs() -> None:
    """Remove every private offload directory of this process (the signal handlers call it)."""
    for directory in list(_PRIVATE_DIRS):
        _remove_private_dir(directory, True)
