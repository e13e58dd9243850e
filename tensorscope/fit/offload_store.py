"""Where offloaded activations go: the tier below the device (its backend's ``tiers``): the disk
tier below a CPU device, host memory below CUDA (and the strict test backend).

A store moves the bytes of one storage out and back. ``begin`` runs where autograd saves the
tensor (the forward's thread: the host store queues the copy out there, ordered after the
kernel that made the tensor), ``finish`` on the writer thread (the disk write; the host store
waits for its copy), ``read`` on the reader thread or inline, ``ready`` where the tensor is
unpacked (the host store's unpacking stream waits for the read). ``release`` gives the copy
back.

# NOTE [the disk tier, reused]
# The CPU store is a ``residency.disk.DiskTier`` of its own (not the residency manager's: its
# lock is not needed, and the manager's budget accounting must not see activations): regions
# carved from unnamed arena files in the private, locked offload directory (``tempdirs.py``),
# written with ``pwrite`` (large page-cache folios), sizes pooled for the next step's tensor of
# the same size. Reads use ``preadv`` into a fresh tensor, never the mapping: the unpacked
# tensor is autograd's to free, and no page of the arena is ever mapped into the process.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any, Protocol

import torch

from tensorscope.errors import InvalidArgumentError, ResidencyError
from tensorscope.fit.offload_rules import Bandwidth
from tensorscope.residency.backends import Backend, Pending, Refused, backend_for
from tensorscope.residency.disk import DiskTier
from tensorscope.residency.mapping import DiskRegion

__all__ = ["DiskStore", "HostStore", "Store", "make_store", "measure_store"]

_READ_CHUNK = 64 << 20


def _bytes_at(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class Store(Protocol):
    """The protocol of a store (see the module docstring)."""

    tier: str
    directory: str | None

    def begin(self, storage: torch.UntypedStorage) -> Any: ...
    def finish(self, storage: torch.UntypedStorage, started: Any) -> Any: ...
    def read(self, copy: Any, nbytes: int) -> Any: ...
    def ready(self, loaded: Any) -> torch.UntypedStorage: ...
    def release(self, copy: Any) -> None: ...
    def close(self) -> None: ...


class DiskStore:
    """Activations in the disk tier's arena files (see the NOTE)."""

    tier = "disk"

    def __init__(self, offload_dir: str | None, reuse_files: bool = True) -> None:
        self._tier = DiskTier(offload_dir)
        self.directory: str | None = self._tier.directory
        self.reuse_files = reuse_files

    @property
    def live_bytes(self) -> int:
        """Bytes of the regions that hold activations now."""
        return self._tier.live_bytes

    @property
    def pooled_bytes(self) -> int:
        """Bytes of file regions kept for the next tensor of the same size."""
        return self._tier.pooled_bytes

    def begin(self, storage: torch.UntypedStorage) -> None:
        return None

    def finish(self, storage: torch.UntypedStorage, started: Any) -> DiskRegion:
        return self._tier.store(storage.data_ptr(), storage.nbytes())

    def read(self, copy: Any, nbytes: int) -> torch.UntypedStorage:
        region: DiskRegion = copy
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes == 0:
            return out.untyped_storage()
        target = _bytes_at(out.data_ptr(), nbytes)
        done = 0
        while done < nbytes:  # preadv may read less than asked (a signal)
            end = min(nbytes, done + _READ_CHUNK)
            got = os.preadv(region.file.fd, [target[done:end]], region.offset + done)
            if got <= 0:
                raise ResidencyError(
                    "tensorscope.fit: an offloaded activation's file ended early (truncated "
                    "behind tensorscope's back); the backward that needed it cannot run."
                )
            done += got
        return out.untyped_storage()

    def ready(self, loaded: Any) -> torch.UntypedStorage:
        storage: torch.UntypedStorage = loaded
        return storage

    def release(self, copy: Any) -> None:
        self._tier.release(copy, reusable=self.reuse_files)

    def close(self) -> None:
        self._tier.close()


class HostStore:
    """Activations in host memory below a device with a host tier, copied by the device's
    backend: pinned memory from its pool (pageable when the pool cannot give it), the copy
    stream out at ``begin``, the copy stream in at ``read`` (base.py's NOTE [the copy rules])."""

    tier = "host"
    directory: str | None = None

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.live_bytes = 0  # bytes of the copies that hold activations now (writer thread)

    def begin(self, storage: torch.UntypedStorage) -> tuple[Any, Any]:
        try:
            host = self.backend.staging(storage.nbytes())
        except Refused as exc:  # finish() raises it on the writer: the tensor stays in memory
            return None, f"tensorscope.fit: no host memory for an offloaded activation: {exc}"
        return host, self.backend.copy_out(host, storage)  # after the kernel that made it

    def finish(self, storage: torch.UntypedStorage, started: Any) -> torch.UntypedStorage:
        host, done = started
        if host is None:
            raise ResidencyError(done)
        done.synchronize()  # then the device storage may go back (the entry lets go of it)
        copied: torch.UntypedStorage = host
        self.live_bytes += copied.nbytes()
        return copied

    def read(self, copy: Any, nbytes: int) -> tuple[torch.UntypedStorage, Pending]:
        out = self.backend.allocate(nbytes, seen=True)  # as DiskStore's: a recording sees it
        return out, self.backend.copy_in(out, copy, background=True)

    def ready(self, loaded: Any) -> torch.UntypedStorage:
        out, done = loaded
        done.wait()  # the stream that unpacks waits for the read, the host goes on
        self.backend.claim(out)  # allocated on the reader thread's stream, used on this one
        storage: torch.UntypedStorage = out
        return storage

    def release(self, copy: Any) -> None:
        self.live_bytes -= copy.nbytes()  # its memory dies with its last reference

    def close(self) -> None:
        return None


def make_store(device: torch.device, offload_dir: str | None, reuse_files: bool) -> Store:
    """The store of the next tier below ``device``."""
    try:
        backend = backend_for(device)
    except InvalidArgumentError as exc:
        raise ResidencyError(
            f"tensorscope.fit: activation offload supports CPU and CUDA devices; got {device}."
        ) from exc
    if backend.tiers[1] == "host":
        return HostStore(backend)
    return DiskStore(offload_dir, reuse_files)


def measure_store(
    store: Store, device: torch.device, nbytes: int = 32 << 20, small_bytes: int = 64 << 10
) -> Bandwidth:
    """Write ``nbytes`` through ``store`` and read them back, synchronously, on this thread; and
    a ``small_bytes`` tensor for the fixed cost per tensor (``Bandwidth.seconds`` predicts a
    transfer from these)."""
    sizes = {}
    for size in (nbytes, small_bytes):
        data = torch.ones(size, dtype=torch.uint8, device=device).untyped_storage()
        start = time.perf_counter()
        copy = store.finish(data, store.begin(data))
        wrote = time.perf_counter() - start
        start = time.perf_counter()
        store.ready(store.read(copy, size))
        backend_for(device).synchronize()
        read = time.perf_counter() - start
        store.release(copy)
        sizes[size] = (wrote, read)
    wrote, read = sizes[nbytes]
    return Bandwidth(
        tier=store.tier,
        nbytes=nbytes,
        write_bytes_per_s=nbytes / wrote if wrote > 0 else 0.0,
        read_bytes_per_s=nbytes / read if read > 0 else 0.0,
        per_tensor_s=sum(sizes[small_bytes]),
    )
