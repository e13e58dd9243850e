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
#
# NOTE [arena watchers]
# The C++ op path checks the canary of an arena before each fast op (residency/native.py), so it
# must know where each canary is now. A tier never calls up into the op path: whoever mirrors
# arenas subscribes here (``watch_arenas``; native.py does when it is imported, with the C++
# engine) and is told when an arena's canary moves (it grew, or was found cut) and when its file
# is closed.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile
import weakref
from bisect import bisect_left
from collections.abc import Callable

from tensorscope._units import format_bytes
from tensorscope.errors import ResidencyError
from tensorscope.residency.checkpoint_files import CheckpointFile
from tensorscope.residency.mapping import PAGE, DiskRegion, MappedFile
from tensorscope.residency.tempdirs import PrivateDir

__all__ = ["Arena", "DiskTier", "watch_arenas"]

LARGE = 2 << 20  # regions this large start at 2 MiB offsets (large folios, 2 MiB mappings)
ARENA_SPAN = 8 << 30  # virtual bytes mapped per arena (the file grows inside it)
_POOL_MIN_BYTES = 64 << 20  # pooled regions may always hold this much (see DiskTier.release)
_CANARY_BYTES = 16


# (moved, closed) pairs: called with an arena whose canary moved, with the fd of a closed one.
_WATCHERS: list[tuple[Callable[[Arena], None], Callable[[int], None]]] = []


def watch_arenas(moved: Callable[[Arena], None], closed: Callable[[int], None]) -> None:
    """Be told of every arena's canary move and close (see the NOTE on arena watchers)."""
    _WATCHERS.append((moved, closed))


def _round_up(value: int, granule: int) -> int:
    return (value + granule - 1) // granule * granule


class Arena(MappedFile):
    """One offload file, mapped whole, from which regions are carved (see the NOTE above)."""

    def __init__(self, fd: int, span: int) -> None:
        super().__init__(fd, span, mmap.MAP_SHARED)
        self._free: list[tuple[int, int]] = [(0, span - PAGE)]  # (offset, length), sorted
        self.high = 0  # end of the data area in the file
        self._canary = os.urandom(_CANARY_BYTES)
        self.cut: int | None = None  # set once the file was found truncated (see refresh)
        self._grow(0)

    # --------------------------------------------------------------------------- allocation
    def carve(self, nbytes: int) -> tuple[int, int] | None:
        """Offset and length of a free range for ``nbytes``, or None if the span is full."""
        if self.cut is not None:  # truncated behind our back: nothing new goes here
            return None
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

    def close(self) -> None:
        fd = self.fd
        super().close()
        if self.fd < 0 <= fd:
            for _, closed in _WATCHERS:
                closed(fd)

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
        self._canary_moved()  # the C++ op path checks the canary where it is now

    # ---------------------------------------------------------------------------- checks/io
    def refresh(self) -> bool:
        """Whether the file lost bytes: its canary is gone (see the NOTE on truncation). Once
        found, the cut is remembered: regions before it are intact (truncation leaves them
        alone), those past it are lost for good, and no new region is carved here."""
        if self.cut is not None:
            return True
        try:
            if os.pread(self.fd, _CANARY_BYTES, self.high) == self._canary:
                return False
            size = os.fstat(self.fd).st_size
        except OSError:
            size = 0
        # Shorter than the data area: cut there. Longer (re-extended, which reads as zeros):
        # where it was cut is unknown, so every region is lost.
        self.cut = size if size < self.high + _CANARY_BYTES else 0
        self._canary_moved()
        return True

    def _canary_moved(self) -> None:
        for moved, _ in _WATCHERS:
            moved(self)

    def lost_reason(self, offset: int, nbytes: int) -> str | None:
        if self.cut is None or offset + nbytes <= self.cut:
            return None
        return (
            "its offload file was truncated (or truncated and re-extended) behind the "
            "manager's back"
        )

    def region(self, offset: int, length: int, nbytes: int) -> DiskRegion:
        return DiskRegion(self, offset, length, nbytes)

    def write(self, region: DiskRegion, address: int) -> None:
        """Copy ``region.nbytes`` from ``address`` into the region, through the file."""
        self.ensure_file_covers(region.offset + region.length)
        region.write(address, self.fd)

    def reserve(self, region: DiskRegion) -> None:
        """Reserve the region's blocks on disk (``posix_fallocate``)."""
        self.ensure_file_covers(region.offset + region.length)
        os.posix_fallocate(self.fd, region.offset, region.length)

    def discard(self, region: DiskRegion) -> None:
        """Free the region's blocks, only inside the data area: the canary after it stays."""
        region.discard(min(region.length, self.high - region.offset))


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
        self._private: PrivateDir | None = None
        if directory is None:
            # Named with the pid and locked: a later process can tell it is stale if this one
            # is killed (see tempdirs.py's NOTE).
            try:
                self._private = PrivateDir()
            except OSError as exc:  # tempfile finds no directory it can write (a full disk)
                raise ResidencyError(
                    f"tensorscope.residency: cannot create a private offload directory: {exc}. "
                    "Free space in the temporary directory, or pass an offload_dir you can "
                    "write to."
                ) from exc
            self.directory = self._private.path
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
        self._finalizer = (
            weakref.finalize(self, PrivateDir.remove, self._private)
            if self._private is not None
            else None
        )
        self.arenas: list[Arena] = []
        self.checkpoints: dict[str, CheckpointFile] = {}  # path -> mapped checkpoint file
        self._retired: list[CheckpointFile] = []  # mapped before the path named a new file
        # The page cache cannot hold more than the machine's memory (see ``streams``).
        self.memory = physical_memory()
        # Regions whose storage died, kept for the next storage of the same size (see release).
        self._pool: dict[int, list[DiskRegion]] = {}
        self.pooled_bytes = 0
        self.live_bytes = 0  # bytes of the regions handed out and not released
        self.check_writable()

    def check_writable(self) -> None:
        """Create an arena and write one page: fails now rather than on the first demotion."""
        region = self._region(PAGE)
        try:
            self._arena(region).write(region, ctypes.addressof(ctypes.create_string_buffer(PAGE)))
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
            self._arena(region).reserve(region)
        except OSError as exc:
            self.release(region, reusable=False)
            raise self._write_error(exc, region.length) from exc
        return region

    def store(self, address: int, nbytes: int) -> DiskRegion:
        """A region holding a copy of the ``nbytes`` at ``address``, written with ``pwrite``
        (large folios; see the NOTE on arenas). A full disk fails the write: nothing has moved."""
        region = self._take_pooled(nbytes) or self._region(nbytes)
        try:
            self._arena(region).write(region, address)
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
        return arena.region(offset, length, nbytes)

    @staticmethod
    def _arena(region: DiskRegion) -> Arena:
        arena = region.file
        if not isinstance(arena, Arena):  # pragma: no cover - checkpoint regions are not written
            raise ResidencyError("tensorscope.residency: internal error: a checkpoint is read-only")
        return arena

    def release(self, region: DiskRegion, reusable: bool) -> None:
        """A region no storage uses any more: pooled for the next storage of its size when
        ``reusable`` (its pages dropped from this process first), else given back to its arena
        with its blocks freed.

        Training makes new gradients every step, each the size of the last one: reusing their
        regions replaces new page-cache memory and writes to fresh blocks by an overwrite of
        cached pages. The pool holds at most as many bytes as the live regions (64 MiB at
        least), so it never more than doubles the files' size.
        """
        if not isinstance(region.file, Arena):  # a checkpoint's region: nothing to free on disk
            region.drop()
            region.file.live -= 1
            return
        self.live_bytes -= region.length
        limit = max(_POOL_MIN_BYTES, self.live_bytes)
        if reusable and region.intact() and self.pooled_bytes + region.length <= limit:
            region.drop()
            self._pool.setdefault(region.nbytes, []).append(region)
            self.pooled_bytes += region.length
        else:
            region.file.discard(region)
            region.file.give_back(region.offset, region.length)

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
        files = [*self.arenas, *self.checkpoints.values(), *self._retired]
        return sum(1 for file in files if file.fd >= 0)

    def streams(self, resident_limit: int) -> bool:
        """Whether the checkpoints mapped, with ``resident_limit`` bytes kept resident beside
        them, are more than the page cache can hold: then each read of a checkpoint's pages is
        dropped from the cache once its placement leaves the device (``DiskRegion.uncache``).

        # NOTE [streaming a checkpoint larger than RAM]
        # Such a model is read from the disk whole in every forward anyway: a sequential scan
        # larger than the cache evicts each page before it is used again. Keeping the pages
        # after use only makes the kernel reclaim them later (CPU spent in reclaim) and pushes
        # other files out. Dropped at once, the same few GiB of memory are reused for the next
        # reads. Measured on this machine, a VM whose host takes idle memory back: the first
        # forward of the 25 GiB model after the machine sat idle went from 36-44 s to 12.5-14.3 s,
        # steady forwards from 13.0-15.6 s to 9.8-11.8 s (docs/design.md section 8).
        """
        if self.memory <= 0:  # unknown: leave the page cache to the kernel
            return False
        files = [*self.checkpoints.values(), *self._retired]
        total = sum(file.span for file in files if file.live > 0)
        return total > 0 and total + resident_limit > self.memory

    def checkpoint_region(
        self, path: str, offset: int, nbytes: int, fingerprint: bool = True
    ) -> DiskRegion:
        """A region of a checkpoint file, mapped once per file (its bytes are the tensor's;
        never written). ``fingerprint``: record the tensor's fingerprint for the integrity
        check (see integrity.py), for a region that stays in use.

        A file mapped earlier is reused only if the path still names the same file, unchanged:
        the caller read the offsets from the header the path names now. Otherwise the path is
        mapped anew; the old mapping stays for the regions that use it."""
        file = self.checkpoints.get(path)
        if file is None or file.fd < 0 or not file.current(path):
            if file is not None:
                self._retired.append(file)
            file = self.checkpoints[path] = CheckpointFile(path)
        if fingerprint:
            file.remember(offset, nbytes)
        file.live += 1
        return DiskRegion(file, offset, nbytes, nbytes)

    def close(self) -> None:
        """Give pooled regions back, close arenas nothing uses, remove the private directory
        (files have no names, so nothing else is left)."""
        for regions in self._pool.values():
            for region in regions:
                self._arena(region).give_back(region.offset, region.length)
        self._pool.clear()
        self.pooled_bytes = 0
        for arena in self.arenas:
            arena.close()
        self.arenas = [arena for arena in self.arenas if arena.fd >= 0]
        for checkpoint in [*self.checkpoints.values(), *self._retired]:
            checkpoint.close()
        self.checkpoints = {k: f for k, f in self.checkpoints.items() if f.fd >= 0}
        self._retired = [f for f in self._retired if f.fd >= 0]
        if self._finalizer is not None:
            self._finalizer()


def physical_memory() -> int:
    """Bytes of RAM in this machine (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
