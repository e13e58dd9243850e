"""The private offload directories (``offload_dir=None``): made, locked, removed, and the stale
ones of killed processes cleaned.

# NOTE [stale private directories]
# A private directory is removed at exit, on SIGTERM and on SIGINT (``signals.py``), but a
# process killed with SIGKILL (or by the OOM killer) runs no code: its directory stays in TMPDIR.
# It is empty (offload files have no names), so it costs an inode, not space; still, nothing
# else would ever remove it. So each process that makes a private directory first removes the
# stale ones of dead processes. Only what is provably ours and dead is touched:
# - the name is ``tensorscope-<pid>-<random>`` (``mkdtemp``), owned by this user, a directory
#   and not a symlink;
# - its owner holds a shared ``flock`` on it for as long as it lives (the kernel drops the lock
#   when the process dies, however it dies; a forked child that inherited the descriptor keeps
#   it alive, which errs on the safe side). A directory whose lock we can take exclusively has
#   no live owner, in any PID namespace sharing this TMPDIR;
# - and the pid in its name is not a live process of this namespace (this closes the window
#   between ``mkdtemp`` and ``flock`` of a process starting right now).
# Then only the files tensorscope itself may have left there (``ts-*.bin``, the fallback for
# file systems without ``O_TMPFILE``) are unlinked, and ``rmdir`` removes the directory only if
# it is then empty: anything else in it is left alone. Directories named the old way
# (``tensorscope-<random>``, no pid, no lock) cannot be told apart from a live one: left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable

__all__ = ["PrivateDir", "clean_stale_dirs", "remove_private_dirs"]

PREFIX = "tensorscope-"
_NAME = re.compile(r"tensorscope-(\d+)-[A-Za-z0-9_]+")
_LEFTOVER = re.compile(r"ts-[A-Za-z0-9_]+\.bin")

# Private directories made by this process (path -> its locked descriptor): removed at exit,
# on SIGTERM and on SIGINT.
_PRIVATE_DIRS: dict[str, int] = {}
_cleaned: set[str] = set()  # parents already cleaned by this process


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process in this PID namespace (another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _open_directory(path: str) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags)


def _remove_if_stale(parent: str, name: str) -> bool:
    """Remove ``parent/name`` if it is a stale private directory (see the NOTE); whether it was."""
    match = _NAME.fullmatch(name)
    if match is None or int(match.group(1)) == os.getpid():
        return False
    path = os.path.join(parent, name)
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        if _alive(int(match.group(1))):
            return False
        fd = _open_directory(path)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner (or a child it forked) still lives
        for entry in os.listdir(fd):
            if _LEFTOVER.fullmatch(entry):
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=fd)
        os.rmdir(path)  # only if empty: what is not ours stays
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def clean_stale_dirs(parent: str | None = None) -> list[str]:
    """Remove the private directories that killed processes left in ``parent`` (default
    TMPDIR); returns their names. Runs once per parent and process (``PrivateDir`` calls it)."""
    parent = parent or tempfile.gettempdir()
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    return [name for name in names if name.startswith(PREFIX) and _remove_if_stale(parent, name)]


class PrivateDir:
    """A new private directory under TMPDIR, locked for this process's lifetime (see the NOTE).

    Example:
        >>> private = PrivateDir()
        >>> os.path.basename(private.path).startswith(f"tensorscope-{os.getpid()}-")
        True
        >>> private.remove(); os.path.exists(private.path)
        False
    """

    def __init__(self) -> None:
        parent = tempfile.gettempdir()
        if parent not in _cleaned:
            _cleaned.add(parent)
            clean_stale_dirs(parent)
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)
        fd = _open_directory(self.path)
        with contextlib.suppress(OSError):  # a fresh directory nobody else knows of
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        _PRIVATE_DIRS[self.path] = fd

    def remove(self) -> None:
        """Remove the directory (idempotent)."""
        _remove_private_dir(self.path)


def _remove_private_dir(
    directory: str,
    _rmtree: Callable[..., None] = shutil.rmtree,  # bound now: also runs at interpreter exit
    _close: Callable[[int], None] = os.close,
) -> None:
    fd = _PRIVATE_DIRS.pop(directory, None)
    _rmtree(directory, ignore_errors=True)
    if fd is not None:
        with contextlib.suppress(OSError):
            _close(fd)


def remove_private_dirs() -> None:
    """Remove every private offload directory of this process (the signal handlers call it)."""
    for directory in list(_PRIVATE_DIRS):
        _remove_private_dir(directory)
