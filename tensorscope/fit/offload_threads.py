"""The writer and reader threads of activation offload (see offload_engine.py's NOTEs).

The writer writes entries in pack order, releases the copies of dead entries, gives the C heap
back after a group's writes, answers ``sync()``, and closes the store once the offloader is
closed and its last entry released. The reader reads prefetched entries into fresh memory.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from tensorscope.errors import ResidencyError
from tensorscope.residency.tiers import free_heap_bytes, release_free_heap

if TYPE_CHECKING:
    from tensorscope.fit.offload_engine import Engine, Entry

__all__ = ["TRIM_BYTES", "read_loop", "write_loop"]

TRIM_BYTES = 64 << 20  # free C heap worth giving back to the OS (offload_engine.py, the heap)


def _write_one(engine: Engine, entry: Entry) -> None:
    storage = entry.storage
    assert storage is not None  # a write job is queued once, before anything drops it
    start = time.perf_counter()
    failure: str | None = None
    copy: Any = None
    try:
        copy = engine.store.finish(storage, entry.started)
    except Exception as exc:  # a full disk: the entry stays in memory, nothing is lost
        # Only its text is kept: the exception's traceback holds this frame, whose locals hold
        # the exception and the storage -- a cycle that kept the storage until the next gc.
        failure = str(exc)
    seconds = time.perf_counter() - start
    changed = False
    watch = entry.watch
    with contextlib.suppress(Exception):  # a disposed ref: its version cannot be read
        changed = watch is not None and watch._version != entry.version
    with engine.cond:
        engine.in_flight -= entry.nbytes
        engine.cond.notify_all()
        entry.watch = None
        entry.started = None
        if failure is not None:
            engine.write_errors += 1
            engine.last_error = failure
            return
        engine.bytes_written += entry.nbytes
        engine.write_s += seconds
        entry.copy = copy
        if changed:
            entry.error = (
                RuntimeError,
                "tensorscope.fit: one of the tensors saved for backward was modified by an "
                "in-place operation while activation offload was writing it out; plain "
                "autograd would raise here too. Clone it before the in-place change.",
            )
        entry.storage = None  # the memory goes back now, unless someone else holds it
        engine._ram(-entry.nbytes)


def write_loop(engine: Engine) -> None:
    while True:
        job = engine.jobs.get()
        kind = job[0]
        try:
            if kind == "write":
                _write_one(engine, job[1])
            elif kind == "release":
                _, copy, key, loaded, nbytes = job
                with engine.lock:
                    found = engine.by_storage.get(key)
                    if found is not None and found[1]() is None:
                        del engine.by_storage[key]
                    engine.live_entries -= 1
                    if copy is None or loaded:  # never written (measure_only, a failed
                        engine._ram(-nbytes, ahead=loaded)  # write), or read back: ours
                if copy is not None:
                    engine.store.release(copy)
            elif kind == "trim":
                if free_heap_bytes() >= TRIM_BYTES:
                    release_free_heap()
                    engine.trims += 1
            elif kind == "sync":
                job[1].set()
            elif kind == "close":
                engine.closing = True
        except Exception as exc:  # pragma: no cover - keep the thread alive whatever happens
            with engine.lock:
                engine.last_error = f"{type(exc).__name__}: {exc}"
        if engine.closing and engine.live_entries <= 0 and not engine.closed:
            with contextlib.suppress(Exception):
                engine.store.close()  # files and the private directory go first
            with engine.lock:
                engine.closed = True
            engine.reads.put(None)
            while True:  # syncs queued before ``closed`` was set
                try:
                    job = engine.jobs.get_nowait()
                except queue.Empty:
                    return
                if job[0] == "sync":
                    job[1].set()


def read_loop(engine: Engine) -> None:
    while True:
        entry = engine.reads.get()
        if entry is None:
            return
        if isinstance(entry, threading.Event):  # sync(): every read queued before is done
            entry.set()
            continue
        with engine.lock:
            copy = entry.copy
            event = entry.reading
            skip = copy is None or entry.loaded is not None or entry.storage is not None
        if not skip:
            start = time.perf_counter()
            try:
                loaded = engine.store.read(copy, entry.nbytes)
            except Exception as exc:
                with engine.lock:
                    entry.error = (
                        ResidencyError,
                        f"tensorscope.fit: an offloaded activation could not be read back: "
                        f"{type(exc).__name__}: {exc}",
                    )
                del exc
            else:
                seconds = time.perf_counter() - start
                with engine.lock:
                    entry.loaded = loaded
                    entry.uses = 0
                    engine._ram(entry.nbytes, ahead=True)
                    engine.bytes_read += entry.nbytes
                    engine.read_s += seconds
        with engine.lock:
            entry.reading = None
        if event is not None:
            event.set()
        del entry
