"""Is a checkpoint file still what ``ts.manage()`` loaded? Cheap content checks.

# NOTE [what a checkpoint change means]
# A checkpoint-backed tensor's memory is the file itself (checkpoint_files.py), so a change of
# the file is a change of the tensor. The modification time says nothing about that: ``touch``,
# ``rsync -t``, a backup tool or ``git checkout`` of the same bytes change it (``git`` and
# ``rsync`` also write a new file and rename it: the mapping keeps the old inode, unaffected).
# What matters: the size (a page past the end raises SIGBUS when read) and the bytes.
# So, at load, each file's status (size, modification and change times: ``FileStatus``), a
# digest of its header, and a *fingerprint* of each stored tensor (a digest of up to three
# 64-byte windows: its first, middle and last bytes) are recorded. Before each op the file's
# status is compared with the last one verified (one ``fstat``, as before). Only when it
# changed is the file verified: the header read again, every tensor's fingerprint recomputed
# and compared. A tensor is intact when it lies inside the file and its fingerprint is
# unchanged; the verdict is kept until the status changes again, so a restored file heals.
# A fingerprint samples, it does not prove: a change inside a tensor that none of its windows
# sees goes unnoticed (as it would with any check short of reading everything).
# Reads use a second descriptor of the same inode (``/proc/self/fd``) advised
# ``POSIX_FADV_RANDOM``: a window costs one page read, and the mapping's readahead state is
# left alone. Costs measured: docs/design.md §8.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["FileStatus", "fingerprint", "header_digest", "reader", "status"]

WINDOW = 64  # bytes per sampled window


class FileStatus(NamedTuple):
    """What ``fstat`` says of a file that matters for its bytes (not its name or inode); a
    tuple, compared at every op (the check costs one ``fstat``, ~2 µs here)."""

    size: int
    mtime_ns: int
    ctime_ns: int


def status(fd: int) -> FileStatus:
    info = os.fstat(fd)
    return FileStatus(info.st_size, info.st_mtime_ns, info.st_ctime_ns)


@contextlib.contextmanager
def reader(fd: int) -> Iterator[int]:
    """A second descriptor of ``fd``'s inode for sampling reads (``fd`` itself where
    ``/proc/self/fd`` is missing)."""
    try:
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield fd
        return
    try:
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(other, 0, 0, os.POSIX_FADV_RANDOM)
        yield other
    finally:
        os.close(other)


def _windows(offset: int, nbytes: int) -> list[tuple[int, int]]:
    if nbytes <= 3 * WINDOW:
        return [(offset, nbytes)]
    middle = offset + (nbytes - WINDOW) // 2 // WINDOW * WINDOW
    return [(offset, WINDOW), (middle, WINDOW), (offset + nbytes - WINDOW, WINDOW)]


def fingerprint(fd: int, offset: int, nbytes: int) -> bytes | None:
    """A digest of the sampled windows of ``nbytes`` at ``offset``; None if they cannot be read
    whole (the file is shorter)."""
    digest = hashlib.blake2b(digest_size=16)
    for start, length in _windows(offset, nbytes):
        try:
            data = os.pread(fd, length, start)
        except OSError:
            return None
        if len(data) != length:
            return None
        digest.update(data)
    return digest.digest()


def header_digest(fd: int) -> bytes | None:
    """A digest of a safetensors file's header (its length and JSON); None if unreadable."""
    try:
        head = os.pread(fd, 8, 0)
        if len(head) != 8:
            return None
        (length,) = struct.unpack("<Q", head)
        if 8 + length > os.fstat(fd).st_size:
            return None
        data = os.pread(fd, length, 8)
    except (OSError, OverflowError, ValueError, MemoryError):
        return None
    if len(data) != length:
        return None
    return hashlib.blake2b(head + data, digest_size=16).digest()
