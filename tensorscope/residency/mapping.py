"""Mapped files and the regions in them: the memory of the disk tier.

A ``MappedFile`` is a file mapped whole into the process: one of tensorscope's own offload files
(an arena, ``disk.py``) or a checkpoint file (``checkpoint_files.py``). A ``DiskRegion`` is one
storage's bytes in such a file; on a CPU device its mapping *is* the storage's memory.
Promoting maps its pages (``MADV_POPULATE_*``), demoting drops them (``MADV_DONTNEED``): the
bytes stay in the page cache and the file. Page-granular calls cover the pages a region touches
(checkpoint tensors need not start on a page).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os

import torch

from tensorscope._torch import ORIGINAL_FROMBUFFER, new_storage

__all__ = ["PAGE", "DiskRegion", "MappedFile", "madvise", "map_file"]

PAGE = mmap.PAGESIZE
_WRITE_CHUNK = 64 << 20  # bytes per pwrite call
MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_MADV_REMOVE = 9
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_FADV_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)

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


def madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)``; returns 0 or the errno. ctypes releases the GIL for the call, so a
    prefetch thread overlaps with compute."""
    if length == 0:
        return 0
    if _libc.madvise(address, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def map_file(fd: int, span: int, flags: int) -> int:
    """``mmap(2)`` of ``span`` bytes of ``fd`` (read and write); the address. Unlike Python's
    ``mmap`` it keeps no duplicate descriptor and may map past the file's end."""
    address = _libc.mmap(None, span, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(address)


class MappedFile:
    """A file mapped whole; regions are views of slices of the mapping."""

    readonly = False  # checkpoint files are never written

    def __init__(self, fd: int, span: int, flags: int) -> None:
        self.fd = fd
        self.span = span
        self.address = map_file(fd, span, flags)
        # The bytes of the whole span as a buffer: storages are made from slices of it.
        self._buffer = memoryview((ctypes.c_char * span).from_address(self.address)).cast("B")
        self.live = 0  # regions handed out and not given back

    def refresh(self) -> bool:
        """Check the file now (one system call on the fast path); whether some of its bytes
        are lost (truncated or changed behind the manager's back)."""
        raise NotImplementedError

    def lost_reason(self, offset: int, nbytes: int) -> str | None:
        """Why the ``nbytes`` at ``offset`` cannot be read through the mapping, as of the last
        ``refresh()``; None if they can."""
        raise NotImplementedError

    def damage(self, offset: int, nbytes: int) -> str | None:
        """``refresh()``, then ``lost_reason()``."""
        return self.lost_reason(offset, nbytes) if self.refresh() else None

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
    """One storage's bytes in a mapped file."""

    __slots__ = ("__weakref__", "address", "file", "length", "nbytes", "offset")

    def __init__(self, file: MappedFile, offset: int, length: int, nbytes: int) -> None:
        self.file = file
        self.offset = offset
        self.length = length
        self.nbytes = nbytes
        self.address = file.address + offset

    @property
    def readonly(self) -> bool:
        """A region of a checkpoint file: never written (copied to an offload file first)."""
        return self.file.readonly

    def _pages(self) -> tuple[int, int]:
        start = self.address - self.address % PAGE
        end = self.address + self.length
        return start, (end + PAGE - 1) // PAGE * PAGE - start

    def storage(self) -> torch.UntypedStorage:
        """A storage whose memory is this region."""
        return self.file.storage(self.offset, self.nbytes)

    def write(self, address: int, fd: int) -> None:
        """Write the ``nbytes`` at ``address`` into the file (``pwrite``, not the mapping)."""
        if self.nbytes == 0:
            return
        source = memoryview((ctypes.c_char * self.nbytes).from_address(address)).cast("B")
        done = 0
        while done < self.nbytes:  # pwrite may write less than asked (a signal, a file limit)
            written = os.pwrite(fd, source[done : done + _WRITE_CHUNK], self.offset + done)
            if written == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += written

    def intact(self) -> bool:
        """Whether the region's bytes can be read (its file not truncated or changed behind
        the manager's back where the region lies)."""
        return self.file.damage(self.offset, self.nbytes) is None

    def damage(self) -> str | None:
        """Why the region's bytes are lost, or None if they are readable."""
        return self.file.damage(self.offset, self.nbytes)

    def populate(self, write: bool) -> bool:
        """Map the region's pages into the process (read ahead from the page cache or disk).
        False if the kernel refused (a file truncated behind our back)."""
        advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
        return madvise(*self._pages(), advice) == 0

    def read_ahead(self) -> None:
        """Ask the kernel to start reading the region's pages (asynchronous readahead)."""
        madvise(*self._pages(), MADV_WILLNEED)

    def drop(self) -> None:
        """Unmap the region's pages: RSS falls, the bytes stay in the page cache and the file."""
        madvise(*self._pages(), _MADV_DONTNEED)

    def uncache(self) -> None:
        """Drop the region's pages from the kernel's page cache as well (``POSIX_FADV_DONTNEED``:
        clean pages no process maps; the next read comes from the disk)."""
        start = self.offset - self.offset % PAGE
        # Advice only: if refused, the pages stay cached and the kernel reclaims them later.
        with contextlib.suppress(OSError):
            os.posix_fadvise(self.file.fd, start, self.offset + self.length - start, _FADV_DONTNEED)

    def discard(self, inside: int) -> None:
        """Drop the region's pages and free the disk blocks of its first ``inside`` bytes."""
        if inside > 0 and madvise(self.address, inside, _MADV_REMOVE) != 0:
            self.drop()

    def flush(self) -> None:
        """Write the file's dirty pages now (``fdatasync``; not the hot path)."""
        if self.file.fd >= 0 and not self.file.readonly:
            os.fdatasync(self.file.fd)
