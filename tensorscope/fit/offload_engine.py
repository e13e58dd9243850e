"""The machinery of activation offload: entries, the writer and reader threads, pack and unpack.

One *entry* per offloaded storage: several saved tensors (views of one storage, the same tensor
saved by two ops) share it, so it is written once. What autograd keeps for a saved tensor is a
small ``Packed`` (the entry, dtype, size, stride, offset); the entry lives as long as some
``Packed`` does, i.e. as long as the graph needs it, and its copy on the tier is given back
when it dies (``__del__`` puts a job on a ``SimpleQueue``, which is safe from finalizers and
garbage collection; the writer thread does the release).

# NOTE [threads and the one lock]
# The writer thread writes entries (in pack order) and releases copies; it is the only thread
# that touches the store's allocation state (``DiskTier`` is not thread-safe). The reader
# thread only reads (``preadv``) into fresh tensors. ``Engine.lock`` (with ``cond``) guards every
# entry's state and the counters; nobody holds it during I/O, and finalizers never take it.
# The forward waits on ``cond`` when more than ``max_in_flight_bytes`` are packed and unwritten:
# that bound is what makes memory drop while the forward runs. The backward waits on an
# entry's read event only if its prefetch has not finished; an entry still being written is
# unpacked from memory (its storage is still held), an entry never prefetched is read inline.
#
# NOTE [the heap]
# Activations of a few MiB are below glibc's (dynamic, up to 32 MiB) mmap threshold: freed after
# their write, they stay in the C heap, resident, and only allocations that fit them reuse
# them; the loss's large logits take fresh memory beside them, so RSS would not fall at the
# peak. So on the CPU, after each group's forward, the writer thread (once the writes queued
# so far are done) gives the free heap back (``malloc_trim``, as the residency manager does)
# when at least ``TRIM_BYTES`` (offload_threads.py) of it are free (docs/design.md section 12).
#
# NOTE [in-place changes]
# With saved-tensor hooks autograd no longer checks a saved tensor's version at unpack. A write
# racing an in-place change of the tensor would store torn bytes, so the writer compares the
# version counter after writing with the one at pack, and an entry changed meanwhile raises at
# unpack (what plain autograd raises). A change after the write completes returns the bytes
# saved (torch's ``save_on_cpu`` does the same). A storage saved again later is shared only if
# its version is unchanged.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tensorscope.fit.offload_rules import GroupStats
from tensorscope.fit.offload_store import Store

__all__ = ["Engine", "Entry", "GroupRun", "Packed"]


def _weak_storage(storage: torch.UntypedStorage) -> StorageWeakRef:
    """A weak reference to the StorageImpl: while it lives, no other storage can have its
    address (``_cdata``), so the address identifies the storage (see ``Engine.by_storage``)."""
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def _expired(weak: StorageWeakRef) -> bool:
    return bool(weak.expired())  # type: ignore[no-untyped-call]


class Entry:
    """One offloaded storage (see the module docstring)."""

    __slots__ = (
        "__weakref__",
        "copy",
        "engine",
        "error",
        "group",
        "handles",
        "key",
        "loaded",
        "nbytes",
        "reading",
        "started",
        "storage",
        "uses",
        "version",
        "watch",
    )

    def __init__(self, engine: Engine, group: int, storage: torch.UntypedStorage, key: int) -> None:
        self.engine = engine
        self.group = group
        self.storage: torch.UntypedStorage | None = storage  # held until written
        self.nbytes = storage.nbytes()
        self.key = key
        self.copy: Any = None  # the bytes on the tier, once written
        self.started: Any = None  # the store's begin() token
        self.loaded: Any = None  # read back, not yet unpacked by every handle
        self.uses = 0  # unpacks since ``loaded`` was read
        self.handles = 0  # saved tensors sharing this entry
        self.reading: threading.Event | None = None  # a prefetch in flight
        # Why the bytes cannot be unpacked: a message, raised anew each time (a stored exception
        # would hold its traceback's frames, and through them the graph that holds this entry).
        self.error: tuple[type[Exception], str] | None = None
        self.watch: torch.Tensor | None = None  # the saved tensor, for its version (until written)
        self.version = 0

    def __del__(self) -> None:
        # A finalizer: no lock, only SimpleQueue.put (reentrant). Interpreter exit may have torn
        # the queue down already; then there is nothing left to release.
        with contextlib.suppress(Exception):
            engine = self.engine
            engine.jobs.put(("release", self.copy, self.key, self.loaded is not None, self.nbytes))


class Packed:
    """What autograd keeps for one offloaded saved tensor."""

    __slots__ = ("dtype", "entry", "offset", "size", "stride")

    def __init__(self, entry: Entry, tensor: torch.Tensor) -> None:
        self.entry = entry
        self.dtype = tensor.dtype
        self.size = tuple(tensor.shape)
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()


class GroupRun:
    """One forward of one group: its entries (weakly: the graph owns them), its statistics, the
    run before it (prefetched when this one's backward starts)."""

    def __init__(self, group: int, previous: GroupRun | None) -> None:
        self.group = group
        self.entries: list[weakref.ref[Entry]] = []
        self.previous = weakref.ref(previous) if previous is not None else None
        self.backward_started = False
        self.saved_tensors = 0
        self.offloaded_bytes = 0
        self.shared_bytes = 0
        self.kept: dict[str, int] = {}

    def stats(self) -> GroupStats:
        return GroupStats(
            group=self.group,
            saved_tensors=self.saved_tensors,
            offloaded_storages=len(self.entries),
            offloaded_bytes=self.offloaded_bytes,
            shared_bytes=self.shared_bytes,
            kept=dict(self.kept),
        )


class Engine:
    """The shared state of one offloader: store, threads, counters (see the NOTEs)."""

    def __init__(
        self, store: Store, max_in_flight_bytes: int, measure_only: bool, trim_heap: bool
    ) -> None:
        self.store = store
        self.trim_heap = trim_heap
        self.trims = 0
        self.max_in_flight_bytes = max_in_flight_bytes
        self.measure_only = measure_only
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.reads: queue.SimpleQueue[Entry | threading.Event | None] = queue.SimpleQueue()
        self.by_storage: dict[int, tuple[StorageWeakRef, weakref.ref[Entry]]] = {}
        self.in_flight = 0
        self.live_entries = 0
        self.accepting = True  # False once close() was called: new saved tensors stay put
        self.closing = False
        self.closed = False
        self.last_run: GroupRun | None = None
        self.runs: dict[int, GroupRun] = {}  # the latest run of each group
        # counters (under ``lock``)
        self.ram_bytes = 0
        self.peak_ram_bytes = 0
        self.ahead_bytes = 0  # of ram_bytes: read back, not yet unpacked by every handle
        self.peak_ahead_bytes = 0
        self.ahead_log: list[tuple[float, int]] | None = None  # (perf_counter, ahead_bytes)
        self.bytes_written = 0
        self.write_s = 0.0
        self.bytes_read = 0
        self.read_s = 0.0
        self.pack_wait_s = 0.0
        self.unpack_wait_s = 0.0
        self.sync_reads = 0
        self.write_errors = 0
        self.last_error: str | None = None
        from tensorscope.fit.offload_threads import read_loop, write_loop

        self._writer = threading.Thread(target=write_loop, args=(self,), daemon=True)
        self._reader = threading.Thread(target=read_loop, args=(self,), daemon=True)
        self._writer.name = "tensorscope-offload-writer"
        self._reader.name = "tensorscope-offload-reader"
        self._writer.start()
        self._reader.start()

    # ------------------------------------------------------------------------- accounting
    def _ram(self, delta: int, *, ahead: bool = False) -> None:
        self.ram_bytes += delta
        self.peak_ram_bytes = max(self.peak_ram_bytes, self.ram_bytes)
        if ahead:
            self.ahead_bytes += delta
            self.peak_ahead_bytes = max(self.peak_ahead_bytes, self.ahead_bytes)
            if self.ahead_log is not None:
                self.ahead_log.append((time.perf_counter(), self.ahead_bytes))

    # ------------------------------------------------------------------------------- pack
    def new_run(self, group: int) -> GroupRun:
        with self.lock:
            last = self.last_run
            usable = last is not None and not last.backward_started and last.group != group
            run = GroupRun(group, last if usable else None)
            self.last_run = run
            self.runs[group] = run
            return run

    def pack(
        self, run: GroupRun, tensor: torch.Tensor, storage: torch.UntypedStorage
    ) -> Packed | None:
        """Offload ``storage`` (the tensor's; ``decide()`` said so) or share its entry; None
        once the offloader is closed (the caller keeps the tensor)."""
        key = storage._cdata
        version = tensor._version
        nbytes = storage.nbytes()
        with self.cond:
            if not self.accepting:
                return None
            found = self.by_storage.get(key)
            entry = found[1]() if found is not None and not _expired(found[0]) else None
            if entry is not None and entry.error is None and entry.version == version:
                entry.handles += 1
                run.shared_bytes += nbytes
                return Packed(entry, tensor)
            if not self.measure_only:
                start = time.perf_counter()
                while self.in_flight > 0 and self.in_flight + nbytes > self.max_in_flight_bytes:
                    self.cond.wait()
                self.pack_wait_s += time.perf_counter() - start
                self.in_flight += nbytes
            entry = Entry(self, run.group, storage, key)
            entry.handles = 1
            entry.version = version
            entry.watch = tensor
            self.by_storage[key] = (_weak_storage(storage), weakref.ref(entry))
            self.live_entries += 1
            self._ram(nbytes)
            run.entries.append(weakref.ref(entry))
            run.offloaded_bytes += nbytes
        if not self.measure_only:
            try:
                entry.started = self.store.begin(storage)
            except BaseException:
                with self.cond:
                    self.in_flight -= nbytes
                    self.cond.notify_all()
                entry.watch = None
                raise
            self.jobs.put(("write", entry))
        else:
            entry.watch = None
        return Packed(entry, tensor)

    # ----------------------------------------------------------------------------- unpack
    def unpack(self, packed: Packed) -> torch.Tensor:
        storage = self._materialize(packed.entry)
        out = torch.empty((0,), dtype=packed.dtype, device=storage.device)
        return out.set_(storage, packed.offset, packed.size, packed.stride)

    def _materialize(self, entry: Entry) -> torch.UntypedStorage:
        while True:
            with self.lock:
                if entry.error is not None:
                    kind, message = entry.error
                    raise kind(message)
                if entry.storage is not None:  # not written yet (or measure_only, or failed)
                    return entry.storage
                if entry.loaded is not None:
                    loaded = entry.loaded
                    entry.uses += 1
                    if entry.uses >= entry.handles:  # every saved tensor has its bytes now
                        entry.loaded = None
                        self._ram(-entry.nbytes, ahead=True)
                    return self.store.ready(loaded)
                event = entry.reading
                copy = entry.copy
            if event is None:
                break
            start = time.perf_counter()
            event.wait()
            with self.lock:
                self.unpack_wait_s += time.perf_counter() - start
        start = time.perf_counter()
        loaded = self.store.read(copy, entry.nbytes)
        seconds = time.perf_counter() - start
        with self.lock:
            self.sync_reads += 1
            self.bytes_read += entry.nbytes
            self.read_s += seconds
            if entry.handles > 1 and entry.loaded is None:  # the others unpack it from memory
                entry.loaded = loaded
                entry.uses = 1
                self._ram(entry.nbytes, ahead=True)
        return self.store.ready(loaded)

    # --------------------------------------------------------------------------- prefetch
    def prefetch(self, run: GroupRun) -> None:
        """Queue the reads of ``run``'s entries on the reader thread, last saved first."""
        queued = []
        with self.lock:
            for ref in reversed(run.entries):
                entry = ref()
                if entry is None or entry.reading is not None or entry.loaded is not None:
                    continue
                if entry.copy is None and entry.storage is not None:
                    continue  # still in memory: nothing to read
                entry.reading = threading.Event()
                queued.append(entry)
        for entry in queued:
            self.reads.put(entry)

    def backward_started(self, run: GroupRun) -> None:
        """Autograd reached ``run``'s outputs: read it and the run before it."""
        with self.lock:
            run.backward_started = True
            previous = run.previous() if run.previous is not None else None
        self.prefetch(run)
        if previous is not None:
            self.prefetch(previous)

    # ------------------------------------------------------------------------------ close
    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every job queued so far ran (reads first: an entry a read held may be
        released after it, then writes and releases); whether it did. The writer's queue is
        synced twice: the last reference to an entry may be a job's own, dropped when the
        writer takes the next job (the sync marker), so its release is queued after it."""
        for target in ("reads", "jobs", "jobs"):
            done = threading.Event()
            with self.lock:
                if self.closed:  # the threads are gone, and nothing is left to do
                    return True
                if target == "reads":
                    self.reads.put(done)
                else:
                    self.jobs.put(("sync", done))
            if not done.wait(timeout):
                return False
        return True

    def close(self) -> None:
        """No new entries; the store closes once the last entry is released."""
        with self.lock:
            self.accepting = False
        self.jobs.put(("close",))
