"""Activation offload: the tensors autograd saves for backward, per block, to the next tier.

On a CPU device they go to the disk tier (files in the private offload directory), on CUDA to
pinned host memory over a side stream. A *group* is one block of the model (one transformer
layer). In the forward, each saved tensor of a group is packed (``saved_tensors_hooks``):
written out on a writer thread, at most ``max_in_flight_bytes`` unwritten at a time, so the
memory drops while the forward goes on. When the backward reaches a group's outputs, that group
and the one before it are read back on a reader thread; an unpack waits only for a read that
has not finished. Results are bit-identical to the plain step: the bytes come back unchanged.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from tensorscope.fit.offload import offload_blocks
    >>> blocks = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(3)])
    >>> handle = offload_blocks(list(blocks), min_bytes=1 << 16)
    >>> blocks(torch.randn(256, 512)).sum().backward()
    >>> handle.offloader.sync(); handle.stats().groups[1].offloaded_bytes > 0
    True
    >>> handle.remove()

# NOTE [when a block is not offloaded]
# A block's forward runs under the pack hooks only when something would be saved (grad mode
# on), outside a backward (``torch.utils.checkpoint``'s reentrant recomputation runs blocks in
# the backward: what it saves is used at once) and when no other saved-tensor hooks are active
# around it (torch applies only the innermost hooks: under a non-reentrant checkpoint,
# ``save_on_cpu`` or ``ts.record()``, theirs decide, and we step aside rather than override
# them). A checkpoint *inside* a block works: its hooks are inner, ours see what it does not
# take over.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tensorscope._copies import Attached, leave_out_of_copies
from tensorscope._torch import graph_task_id
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError, ResidencyError
from tensorscope.fit.offload_engine import Engine, GroupRun
from tensorscope.fit.offload_pack import (
    Group,
    hooks_enabled,
    other_hooks,
    storage_ptrs,
    tensors_in,
)
from tensorscope.fit.offload_rules import (
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_MIN_BYTES,
    Bandwidth,
    GroupStats,
    OffloadStats,
)
from tensorscope.fit.offload_store import make_store, measure_store
from tensorscope.residency.backends import backend_for

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT_BYTES",
    "DEFAULT_MIN_BYTES",
    "ActivationOffloader",
    "Bandwidth",
    "GroupStats",
    "OffloadHandle",
    "OffloadStats",
    "offload_blocks",
]


class ActivationOffloader:
    """Offload what autograd saves in groups of a forward to the tier below ``device``.

    Args:
        device: the compute device (``"cpu"``: the disk tier; ``"cuda"``: pinned host memory;
            the tier below it is its backend's, ``residency/backends``).
        offload_dir: where the disk tier's files go (default: a private temporary directory,
            removed at exit, see ``residency/tempdirs.py``).
        min_bytes: storages smaller than this stay in memory.
        max_in_flight_bytes: packed and unwritten bytes before the forward waits for the writer.
        measure_only: decide and count, but write nothing (``stats()`` then says what offload
            would take out of memory, per group, at no I/O cost).
        reuse_files: keep file regions of dead activations for the next step's tensors of the
            same size (the disk tier's pool), rather than freeing their blocks.
        trim_heap: where the device's memory is the C heap (the CPU), give its free memory back
            to the OS after a group's writes (``malloc_trim``; offload_engine.py's NOTE [the
            heap]).

    Example:
        >>> import torch
        >>> offloader = ActivationOffloader("cpu", min_bytes=0)
        >>> w = torch.randn(64, 64, requires_grad=True)
        >>> with offloader.group(0):
        ...     loss = (torch.randn(64, 64) @ w).tanh().sum()
        >>> offloader.prefetch(0); loss.backward()
        >>> offloader.stats().groups[0].offloaded_storages
        2
        >>> offloader.close()
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        offload_dir: str | None = None,
        min_bytes: int = DEFAULT_MIN_BYTES,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        measure_only: bool = False,
        reuse_files: bool = True,
        trim_heap: bool = True,
    ) -> None:
        for name, value in (("min_bytes", min_bytes), ("max_in_flight_bytes", max_in_flight_bytes)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ArgumentTypeError(f"tensorscope.fit: {name} takes an int; got {value!r}")
            if value < 0:
                raise InvalidArgumentError(f"tensorscope.fit: {name} must be >= 0; got {value}")
        self.device = torch.device(device)
        self.min_bytes = min_bytes
        self.measure_only = measure_only
        self._offload_dir = offload_dir
        store = make_store(self.device, offload_dir, reuse_files)
        backend = backend_for(self.device)
        self.device = backend.device  # "cuda" is the current device's index
        self.tier = store.tier
        self.directory = store.directory
        self._store = store
        trim = trim_heap and backend.heap_device and not measure_only
        self._engine = Engine(store, max(1, max_in_flight_bytes), measure_only, trim)
        self._finalizer = weakref.finalize(self, Engine.close, self._engine)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (saved activations still in use stay readable)."""
        return not self._finalizer.alive

    def group(self, group: int, context: Iterable[torch.Tensor] = ()) -> Group:
        """A context manager: what autograd saves inside it belongs to ``group`` (an ``int``;
        groups are prefetched in reverse order of their forwards). ``context``: tensors the
        caller holds for the whole step (masks, position embeddings): never offloaded."""
        if self.closed:
            raise ResidencyError("tensorscope.fit: this ActivationOffloader is closed.")
        if not isinstance(group, int) or isinstance(group, bool):
            raise ArgumentTypeError(f"tensorscope.fit: a group is an int; got {group!r}")
        return Group(self._engine, self.device, self.min_bytes, group, storage_ptrs(context))

    def prefetch(self, group: int) -> None:
        """Start reading back the latest forward of ``group`` (no-op if nothing is out)."""
        run = self._engine.runs.get(group)
        if run is not None:
            self._engine.prefetch(run)

    def sync(self, timeout: float | None = 30.0) -> None:
        """Wait until the writes and releases queued so far are done (tests, measurements)."""
        if not self._engine.sync(timeout):
            raise ResidencyError("tensorscope.fit: the offload writer did not finish in time.")

    def stats(self) -> OffloadStats:
        """A snapshot of the counters (see ``OffloadStats``)."""
        engine = self._engine
        with engine.lock:
            return OffloadStats(
                tier="none" if self.measure_only else self.tier,
                groups={group: run.stats() for group, run in sorted(engine.runs.items())},
                ram_bytes=engine.ram_bytes,
                peak_ram_bytes=engine.peak_ram_bytes,
                tier_bytes=int(getattr(self._store, "live_bytes", 0)),
                live_entries=engine.live_entries,
                bytes_written=engine.bytes_written,
                write_s=engine.write_s,
                bytes_read=engine.bytes_read,
                read_s=engine.read_s,
                pack_wait_s=engine.pack_wait_s,
                unpack_wait_s=engine.unpack_wait_s,
                sync_reads=engine.sync_reads,
                write_errors=engine.write_errors,
                last_error=engine.last_error,
                trims=engine.trims,
                peak_read_ahead_bytes=engine.peak_ahead_bytes,
            )

    def reset_peak(self) -> None:
        """Start ``peak_ram_bytes`` (and ``peak_read_ahead_bytes``) again from the bytes held
        now."""
        engine = self._engine
        with engine.lock:
            engine.peak_ram_bytes = engine.ram_bytes
            engine.peak_ahead_bytes = engine.ahead_bytes

    def log_read_ahead(self, start: bool) -> list[tuple[float, int]]:
        """What was logged since the last call: ``(time.perf_counter(), bytes)`` at each
        change of the bytes held read back ahead of use; then log again (``start``) or stop.
        ``ts.fit`` lines this up with a recorded step's ops."""
        engine = self._engine
        with engine.lock:
            log = engine.ahead_log or []
            now = [(time.perf_counter(), engine.ahead_bytes)]
            engine.ahead_log = now if start else None
        return log

    def measure_bandwidth(self, nbytes: int = 32 << 20, small_bytes: int = 64 << 10) -> Bandwidth:
        """Write ``nbytes`` to the tier and read them back, synchronously, on this thread; and
        a ``small_bytes`` tensor for the fixed cost per tensor. For the planner's estimate of
        a group's offload time (``Bandwidth.seconds``); collected stats say the same from real
        steps (``stats().write_bandwidth``)."""
        # A store of its own (the writer thread owns the offloader's), in the same directory.
        store = make_store(self.device, self._offload_dir, reuse_files=False)
        try:
            return measure_store(store, self.device, nbytes, small_bytes)
        finally:
            store.close()

    def close(self) -> None:
        """No new groups; the tier's files go once the last saved activation is released
        (graphs still alive keep working). Idempotent."""
        self._finalizer()


class OffloadHandle:
    """What :func:`offload_blocks` returns: ``remove()`` takes the hooks off the blocks."""

    def __init__(
        self, offloader: ActivationOffloader, groups: tuple[int, ...], owned: bool
    ) -> None:
        self.offloader = offloader
        self.groups = groups
        self._owned = owned
        self._handles: list[RemovableHandle | Attached] = []
        self.removed = False

    def stats(self) -> OffloadStats:
        """The offloader's statistics (``OffloadStats``)."""
        return self.offloader.stats()

    def remove(self) -> None:
        """Restore the blocks exactly (hooks removed); close the offloader if this call made
        it. Graphs built before keep working. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._owned:
            self.offloader.close()
        self.removed = True

    def __enter__(self) -> OffloadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _BlockHooks:
    """The hooks of one block: push the group's pack hooks around its forward (per thread),
    and ask for the prefetch when the backward reaches its outputs."""

    def __init__(self, offloader: ActivationOffloader, module: nn.Module, group: int) -> None:
        self.offloader = offloader
        self.module = module
        self.group = group
        self._local = threading.local()

    def _stack(self) -> list[Group | None]:
        stack: list[Group | None] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stack = self._stack()
        if (
            self.offloader.closed
            or not torch.is_grad_enabled()
            or graph_task_id() != -1  # in a backward (see the NOTE)
            or not hooks_enabled()
            or other_hooks()
        ):
            stack.append(None)
            return
        context = [*tensors_in(args[1:]), *tensors_in(kwargs)]
        context.extend(module.parameters())
        context.extend(module.buffers())
        group = Group(
            self.offloader._engine,
            self.offloader.device,
            self.offloader.min_bytes,
            self.group,
            storage_ptrs(context),
        )
        group.__enter__()
        stack.append(group)

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        stack = self._stack()
        group = stack.pop() if stack else None
        if group is None:
            return
        group.__exit__(None, None, None)
        run = weakref.ref(group.run)
        engine = weakref.ref(self.offloader._engine)
        nodes = {id(t.grad_fn): t.grad_fn for t in tensors_in(output) if t.grad_fn is not None}
        for node in nodes.values():
            node.register_prehook(lambda grads, run=run, engine=engine: _started(engine, run))


def _started(engine_ref: weakref.ref[Engine], run_ref: weakref.ref[GroupRun]) -> None:
    engine, run = engine_ref(), run_ref()
    if engine is not None and run is not None and not run.backward_started:
        engine.backward_started(run)


def offload_blocks(
    blocks: Sequence[nn.Module],
    groups: Iterable[int] | None = None,
    *,
    offloader: ActivationOffloader | None = None,
    device: torch.device | str | None = None,
    **options: Any,
) -> OffloadHandle:
    """Offload the saved activations of ``blocks[i]`` for each ``i`` in ``groups`` (default:
    every block); the group of ``blocks[i]`` is ``i``.

    Each chosen block's forward runs under the pack hooks of its group; when the backward
    reaches a block's outputs, its group and the previous block's are read back. Pass an
    ``offloader`` to share one between calls (it is then not closed by ``remove()``); else one
    is made on ``device`` (default: the first block's parameters' device) with ``options``
    (``ActivationOffloader``'s keyword arguments).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        >>> with offload_blocks(layers, groups=[1, 2], min_bytes=0) as handle:
        ...     x = torch.randn(2, 8)
        ...     for layer in layers:
        ...         x = layer(x).relu()
        ...     x.sum().backward()
        >>> sorted(handle.stats().groups)
        [1, 2]
    """
    modules = list(blocks)
    if not all(isinstance(block, nn.Module) for block in modules):
        raise ArgumentTypeError("tensorscope.fit: offload_blocks() takes a sequence of nn.Modules")
    chosen = tuple(range(len(modules))) if groups is None else tuple(groups)
    for index in chosen:
        if not isinstance(index, int) or isinstance(index, bool):
            raise ArgumentTypeError(f"tensorscope.fit: a group is a block index; got {index!r}")
        if not 0 <= index < len(modules):
            raise InvalidArgumentError(
                f"tensorscope.fit: group {index} is not a block index (0..{len(modules) - 1})"
            )
    owned = offloader is None
    if offloader is None:
        if device is None:
            first = next((p for m in modules for p in m.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        offloader = ActivationOffloader(device, **options)
    elif options or device is not None:
        raise InvalidArgumentError(
            "tensorscope.fit: pass either an offloader or its options (device, min_bytes, ...)"
        )
    handle = OffloadHandle(offloader, chosen, owned)
    for index in dict.fromkeys(chosen):
        hooks = _BlockHooks(offloader, modules[index], index)
        module = modules[index]
        pre = module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
        post = module.register_forward_hook(hooks.post, always_call=True)
        # NOTE [copies of a module we attached to] (_copies.py): a copy is the plain block
        handle._handles += [pre, post, leave_out_of_copies(module, [pre, post])]
    return handle
