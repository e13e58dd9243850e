"""Exact live-bytes accounting of the tensors ops allocate, on any device (CPU included).

PyTorch's CPU allocator keeps no statistics, so this counts storages itself: a
``TorchDispatchMode`` sees every tensor every op returns (forward, autograd's backward,
factories), and ``weakref.finalize`` on the storage tells when it is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tensorscope._modes import DispatchMode

__all__ = ["StorageTracker"]

# NOTE [storage accounting on CPU]
# An op's output is a new allocation iff its storage is neither tracked already nor shared with
# one of the op's tensor arguments (views, in-place and out= ops return an argument's storage).
# New storages are counted at their full ``nbytes()`` (a slice keeps its whole storage alive)
# and watched with ``weakref.finalize``: PyTorch keeps a storage's Python object alive exactly
# as long as the C++ storage, so the callback fires when the memory is really released --
# including storages only autograd's saved tensors still reference. Keys are the storages'
# C++ addresses, paired with a serial number so a reused address is never confused with a
# freed one. What this cannot see: scratch memory inside a single kernel (workspaces that a
# kernel allocates and frees before returning), and memory that is not a tensor. Nor what
# torch.compile'd code allocates (an inductor kernel makes its outputs below the dispatcher):
# so while the tracker is pushed, torch.compile runs code eagerly (``eager_under_compile``,
# _modes.py's NOTE [our modes and torch.compile]).


class StorageTracker(DispatchMode):
    """Count the bytes of live storages allocated while the mode is active.

    ``live_nbytes`` and ``peak_nbytes`` only count storages created inside the ``with`` block
    (tensors that existed before are not counted). :meth:`reset_peak` starts a window whose
    peak :meth:`window_peak` can recompute without some storages (e.g. parameter gradients).

    Example:
        >>> import torch
        >>> with StorageTracker() as tracker:
        ...     a = torch.ones(256)          # 1 KiB
        ...     b = (a + 1) * 2              # a temporary (a + 1), then b
        ...     del a
        >>> tracker.peak_nbytes, tracker.live_nbytes
        (3072, 1024)
    """

    eager_under_compile = True  # see the NOTE above

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live_nbytes = 0
        self.peak_nbytes = 0
        self._alive: dict[int, tuple[int, int]] = {}  # storage address -> (serial, nbytes)
        self._finalizers: dict[int, weakref.finalize[Any, Any]] = {}
        self._log: list[tuple[int, int]] = []  # (serial, +/- nbytes), in order
        self._serial = 0
        self._mark = 0
        self._mark_live = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: set[int] | None = None
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
                continue
            key = storage._cdata
            if key in self._alive:
                self._resized(key, storage.nbytes())
                continue
            if inputs is None:
                inputs = _storage_keys((args, kwargs))
            if key not in inputs and storage.nbytes() > 0:
                self._allocated(key, storage)
        return out

    def _allocated(self, key: int, storage: torch.UntypedStorage) -> None:
        self._serial += 1
        nbytes = storage.nbytes()
        self._alive[key] = (self._serial, nbytes)
        self._finalizers[self._serial] = weakref.finalize(storage, self._freed, key, self._serial)
        self._change(self._serial, nbytes)

    def _resized(self, key: int, nbytes: int) -> None:
        serial, old = self._alive[key]
        if nbytes != old:
            self._alive[key] = (serial, nbytes)
            self._change(serial, nbytes - old)

    def _freed(self, key: int, serial: int) -> None:
        self._finalizers.pop(serial, None)
        entry = self._alive.get(key)
        if entry is not None and entry[0] == serial:
            del self._alive[key]
            self._change(serial, -entry[1])

    def _change(self, serial: int, delta: int) -> None:
        self._log.append((serial, delta))
        self.live_nbytes += delta
        self.peak_nbytes = max(self.peak_nbytes, self.live_nbytes)

    @property
    def serial(self) -> int:
        """The serial number of the latest storage counted (0: none yet)."""
        return self._serial

    def serial_of(self, key: int) -> int | None:
        """The serial number of the live storage whose key is ``key`` (None: not counted)."""
        entry = self._alive.get(key)
        return entry[0] if entry is not None else None

    def reset_peak(self) -> None:
        """Start a new window: ``peak_nbytes`` restarts from the current live bytes."""
        self._mark = len(self._log)
        self._mark_live = self.live_nbytes
        self.peak_nbytes = self.live_nbytes

    def window_peak(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Peak live bytes since :meth:`reset_peak`, not counting the storages of ``exclude``
        allocated in the window (e.g. parameter gradients, which mem_limit leaves out)."""
        skip = {self._alive[k][0] for k in _storage_keys(list(exclude)) if k in self._alive}
        live = peak = self._mark_live
        for serial, delta in self._log[self._mark :]:
            if serial not in skip:
                live += delta
                peak = max(peak, live)
        return peak

    def close(self) -> None:
        """Stop watching the storages still alive (drops their finalizers)."""
        for fin in list(self._finalizers.values()):
            fin.detach()
        self._finalizers.clear()


def _storage_keys(tree: Any) -> set[int]:
    keys: set[int] = set()
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            try:
                keys.add(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                continue
    return keys
