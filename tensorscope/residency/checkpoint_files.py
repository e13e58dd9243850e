"""Safetensors checkpoints as the disk tier: their headers, and the files mapped read-only.

``read_checkpoint(path)`` takes one ``.safetensors`` file or a directory with
``model.safetensors`` or ``model.safetensors.index.json`` (what ``save_pretrained`` writes) and
returns where each stored tensor's bytes lie, reading headers only: the ``safetensors`` package
validates each file (a truncated or corrupt one is refused here, never later), and the data
offsets come from the header itself (the documented format: an 8-byte little-endian length, a
JSON header, the data). The fingerprints of the integrity check are read when a tensor is
placed (``CheckpointFile.remember``).

# NOTE [a checkpoint file as the disk tier]
# A stored tensor whose dtype is the parameter's needs no copy: its storage is the mapping of
# the file at its offset (``CheckpointFile``: mapped private, so the file is never written even by
# mistake). Promoting maps its pages from the page cache or the disk, demoting drops them. A
# tensor that is to be written (an optimizer step, ``copy_``) first gets its own offload file
# (copy on first write: ``Movers.relocate``). Before anything touches the mapping the file is
# checked (``refresh``: its status, and when that changed its header and the fingerprints of
# its tensors; integrity.py's NOTE): a tensor whose bytes were truncated away or changed behind
# the manager's back raises ``ResidencyError`` instead of SIGBUS or silently other weights, and
# the other tensors of the file go on working. Writing to a checkpoint-backed tensor from a
# thread tensorscope does not intercept lands in private memory that a later demotion
# discards: use managed tensors from the thread that called ``ts.manage()`` or one with a
# scope open.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tensorscope._units import format_bytes
from tensorscope.errors import ArgumentTypeError, ResidencyError
from tensorscope.residency.integrity import FileStatus, fingerprint, header_digest, reader, status
from tensorscope.residency.mapping import PAGE, MappedFile

__all__ = ["CheckpointFile", "StoredTensor", "checkpoint_files", "read_checkpoint"]

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class StoredTensor:
    """Where one stored tensor's bytes are."""

    key: str
    path: str
    offset: int  # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _error(path: str, what: str) -> ResidencyError:
    return ResidencyError(f"tensorscope.residency: checkpoint {path!r}: {what}")


def checkpoint_files(checkpoint: str | os.PathLike[str]) -> list[str]:
    """The ``.safetensors`` files of ``checkpoint`` (a file, or a directory laid out by
    ``save_pretrained``)."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise ArgumentTypeError(
            "tensorscope.residency: checkpoint= takes a path to a .safetensors file or a "
            f"directory; got {type(checkpoint).__name__}."
        )
    path = os.path.abspath(os.fspath(checkpoint))
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise _error(path, "no such file or directory.")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _error(index, f"unreadable index ({exc}).") from exc
        return [os.path.join(path, name) for name in names]
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return [single]
    raise _error(path, f"holds neither {SINGLE} nor {INDEX}.")


def _header(path: str) -> tuple[int, dict[str, object]]:
    """The data start and the JSON header of one file (validated by ``safetensors`` first)."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as exc:  # pragma: no cover - installed with the [checkpoint] extra
        raise ResidencyError(
            "tensorscope.residency: loading a checkpoint needs the safetensors package "
            "(pip install 'tensorscope[checkpoint]')."
        ) from exc
    try:
        with safe_open(path, framework="pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise _error(path, f"not a valid safetensors file (truncated or corrupt?): {exc}") from exc
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return 8 + length, header


def read_checkpoint(checkpoint: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    """Every stored tensor of ``checkpoint`` by key (headers only).

    Raises:
        ResidencyError: no such path, no safetensors layout, a truncated or corrupt file, a
            dtype tensorscope cannot map, or a key stored twice.
    """
    stored: dict[str, StoredTensor] = {}
    for path in checkpoint_files(checkpoint):
        start, header = _header(path)
        size = os.path.getsize(path)
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype = _DTYPES[entry["dtype"]]  # type: ignore[index]
                begin, end = entry["data_offsets"]  # type: ignore[index]
                shape = tuple(int(n) for n in entry["shape"])  # type: ignore[index]
            except (KeyError, TypeError, ValueError) as exc:
                raise _error(path, f"tensor {key!r} has an unusable header entry.") from exc
            if start + end > size:
                raise _error(path, f"tensor {key!r} lies past the end of the file (truncated).")
            if key in stored:
                raise _error(path, f"tensor {key!r} is stored twice.")
            stored[key] = StoredTensor(key, path, start + begin, end - begin, dtype, shape)
    return stored


class CheckpointFile(MappedFile):
    """A checkpoint file mapped whole and private, with the integrity check of integrity.py."""

    readonly = True

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            info = os.fstat(fd)
            span = max(PAGE, info.st_size)
            super().__init__(fd, span, mmap.MAP_PRIVATE)
        except OSError as exc:
            os.close(fd)
            raise _error(path, f"cannot map it: {exc.strerror}") from exc
        self.path = path
        self.identity = (info.st_dev, info.st_ino)
        self.loaded = FileStatus(info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        self._checked = self.loaded  # the status last verified
        self._header = header_digest(fd)
        self._prints: dict[int, tuple[int, bytes | None]] = {}  # offset -> nbytes, fingerprint
        self._lost: dict[int, str] = {}  # offset -> why, as of ``_checked``

    def remember(self, offset: int, nbytes: int) -> None:
        """Record the fingerprint of the tensor at ``offset`` (at load: one to three page reads)."""
        if offset in self._prints:
            return
        with reader(self.fd) as fd:
            self._prints[offset] = (nbytes, fingerprint(fd, offset, nbytes))

    def current(self, path: str) -> bool:
        """Whether ``path`` still names this file and nothing of it was lost."""
        try:
            info = os.stat(path)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.identity and not self.refresh()

    def refresh(self) -> bool:
        try:
            now = status(self.fd)
        except OSError as exc:
            why = f"checkpoint {self.path!r} cannot be checked any more ({exc.strerror})"
            self._lost = dict.fromkeys(self._prints, why)
            self._checked = FileStatus(-1, -1, -1)
            return True
        if now != self._checked:  # touched, rewritten, truncated...: look at the bytes
            self._lost = self._verify(now.size)
            self._checked = now
        return bool(self._lost)

    def _verify(self, size: int) -> dict[int, str]:
        lost: dict[int, str] = {}
        with reader(self.fd) as fd:
            header = "" if header_digest(fd) == self._header else " (its header changed too)"
            for offset, (nbytes, expected) in self._prints.items():
                if offset + nbytes > size:
                    lost[offset] = (
                        f"checkpoint {self.path!r} was truncated to {size} bytes: this "
                        f"tensor's bytes {offset}..{offset + nbytes} lie past its end"
                    )
                elif expected is not None and fingerprint(fd, offset, nbytes) != expected:
                    lost[offset] = (
                        f"checkpoint {self.path!r} was overwritten{header}: this tensor's bytes "
                        "differ from those ts.manage() loaded"
                    )
        return lost

    def lost_reason(self, offset: int, nbytes: int) -> str | None:
        reason = self._lost.get(offset)
        if reason is None and offset not in self._prints and offset + nbytes > self._checked.size:
            reason = f"checkpoint {self.path!r} was truncated to {self._checked.size} bytes"
        return reason


def describe(tensors: Iterable[StoredTensor]) -> str:
    """ "N tensors, X GiB" for messages and reports."""
    items = list(tensors)
    return f"{len(items)} tensors, {format_bytes(sum(t.nbytes for t in items))}"
