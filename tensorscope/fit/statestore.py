"""Optimizer state in the next tier between updates: each parameter's state (AdamW's two moments)
is written out after its update and read back just before the next one. See NOTE [optimizer
state between updates].
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tensorscope._sharded import local_tensor, rebuilder
from tensorscope.errors import FitWarning, InvalidArgumentError, ResidencyError
from tensorscope.fit.inbackward import KNOWN_OPTIMIZERS, narrowed
from tensorscope.fit.offload_rules import Bandwidth
from tensorscope.fit.offload_store import Store, make_store, measure_store
from tensorscope.fit.placeholders import placeholder_of
from tensorscope.fit.rows import row_ranges
from tensorscope.ref import unown
from tensorscope.residency.backends import backend_for

__all__ = ["MIN_SPILL_BYTES", "StateStore", "per_parameter_state_bytes", "row_safe"]

# NOTE [optimizer state between updates]
# After a parameter's update (the optimizer's step, or its per-parameter step inside backward),
# each tensor of its state of at least MIN_SPILL_BYTES (AdamW's exp_avg and exp_avg_sq, not the
# scalar `step`) is written to the store (the disk tier on a CPU device, pinned host memory on
# CUDA: fit/offload_store.py) and replaced in `optimizer.state[p]` by a meta tensor of the same
# shape and dtype, so its memory goes back at once and nothing can read stale values. Before
# the parameter's next update (the optimizer's step pre-hook, which also runs for each
# per-parameter step) the bytes are read into a new tensor that takes the placeholder's place.
# Replacing the entry, rather than resizing the storage in place, keeps every tensor anyone
# holds whole: a `state_dict()` taken between steps is made with the state read back (its
# pre-hook) and keeps its own tensors (its post-hook copies the per-parameter dicts before the
# state is written out again). After `load_state_dict()` the entries are new tensors: the
# records of the old ones are dropped, and the new ones are written out after the next update.
# A failed write leaves the tensor where it was (resident); nothing is lost.
#
# NOTE [a full disk]
# A write that fails (ENOSPC, a file size limit; or the store's files cannot be made) leaves
# that tensor in memory, warns once (FitWarning), and sets `off`: from then on nothing more is
# written (the next writes would fail too) and `measure()` says the tier cannot be written
# (None), as it does when its probe write fails before the first decision. ts.fit reads that:
# at the end of the step it reads every tensor back (`disable()`) and decides again with the
# state in memory (and no activation offload: the same tier); where nothing fits then, the
# ScheduleError names the failure. Every write path is covered: the decision's first spill,
# the update inside backward, a kept-gradient step one parameter at a time, a row block.

MIN_SPILL_BYTES = 4096


# NOTE [updates in row blocks]
# A state tensor larger than ROW_BLOCK_BYTES (4 MiB; a 50k-word embedding's AdamW moments: 147 MiB
# each) is written out in blocks of whole rows (fit/rows.py). When the gradients are freed at
# their update (one parameter's step at a time, fit/inbackward.py), such a parameter is updated
# block by block: for each block, a view of the parameter's rows with the same rows of its
# gradient is given to the user's optimizer (`param_groups` narrowed to it) with that block of
# each state tensor read back, and a copy of the rest of the state (the `step` count); then the
# block is written out again. The update holds one block of state and of the update's
# temporaries instead of all of it. Only for optimizers whose update is elementwise
# (KNOWN_OPTIMIZERS, not `fused`: the fused kernels round differently at a block's edges), where
# the result is bit-identical to one whole update (tests/fit/test_fit_state_rows.py). A block whose
# write fails stays in memory (FitWarning), as a whole tensor does; a read that fails in the
# middle leaves the earlier blocks updated and raises (the file was damaged behind our back).
#
# NOTE [sharded state]
# Under FSDP2 a parameter's state is made of ``DTensor``s (AdamW's moments, sharded like the
# parameter): what is written is this rank's local tensor, the placeholder has the DTensor's
# global shape, and the value read back is a DTensor again, made from the local tensor read
# back with the same mesh, placements, shape and stride (``_sharded.rebuilder``). Row blocks
# are not used for it (a row view of a sharded DTensor would be a collective's business).
#
# NOTE [a kept-gradient step one parameter at a time]
# With gradients kept until `optimizer.step()` (clipping, a GradScaler, accumulation) and the
# state in the next tier, reading every parameter's state back for the step would hold all of
# it at once. So with `stepwise` on, the optimizer's step pre-hook runs the update itself, one
# parameter at a time: the user's optimizer (its class's `step`, `param_groups` narrowed to the
# parameter, fit/inbackward.py) with that parameter's state read back -- in row blocks where it
# is split (NOTE [updates in row blocks]) -- then written out again. Each updated parameter's
# gradient is set aside, so the step itself finds no gradient and updates nothing (torch's
# optimizers skip a parameter whose `.grad` is None), and the gradients are put back by the
# step's post-hook (or at once if an update raises). The step holds one parameter's state (or
# one block of it) instead of all. Same bits as the whole step for KNOWN_OPTIMIZERS on the CPU:
# their per-tensor code is what the whole step runs. A step given a closure runs whole.


@dataclass
class _Block:
    start: int  # rows
    stop: int
    copy: Any  # in the store; None: kept in memory (its write failed)
    nbytes: int
    kept: torch.Tensor | None = None


@dataclass
class _Spilled:
    placeholder: torch.Tensor
    copy: Any
    nbytes: int
    storage_offset: int
    dtype: torch.dtype
    device: torch.device
    blocks: list[_Block] | None = None  # written in row blocks (then `copy` is None)
    # NOTE [sharded state]: a DTensor's local tensor is what is written; made again from it
    rebuild: Callable[[torch.Tensor], torch.Tensor] | None = None
    shape: tuple[int, ...] = ()  # the local tensor's (a DTensor's placeholder has the global)
    stride: tuple[int, ...] = ()


def _below(device: torch.device) -> str:
    """The tier below ``device`` (its backend's), "disk" for a device no backend serves."""
    try:
        return backend_for(device).tiers[1]
    except InvalidArgumentError:
        return "disk"


def _spillable(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.device.type != "meta"
        and value.layout is torch.strided
        and value.nbytes >= MIN_SPILL_BYTES
        and not value.requires_grad
    )


def _counted(value: Any) -> bool:  # spillable, or a placeholder of a spilled tensor
    return (
        isinstance(value, torch.Tensor)
        and value.layout is torch.strided
        and value.nbytes >= MIN_SPILL_BYTES
        and not value.requires_grad
    )


def _per_element(value: Any, p: torch.Tensor) -> bool:
    """A state tensor with one entry per element of ``p`` (its rows go with ``p``'s rows)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape


def _in_rows(value: torch.Tensor, block: int) -> list[tuple[int, int]] | None:
    """The row blocks ``value`` is written in (None: written whole)."""
    if (
        block <= 0
        or value.dim() < 1
        or not value.is_contiguous()
        or value.storage_offset() != 0
        or value.untyped_storage().nbytes() != value.nbytes
    ):
        return None
    ranges = row_ranges(tuple(value.shape), value.nbytes, block)
    return ranges if len(ranges) > 1 else None


def row_safe(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s update of a block of rows equals the same rows of a whole update
    (NOTE [updates in row blocks])."""
    return type(optimizer) in KNOWN_OPTIMIZERS and not any(
        g.get("fused")
        or g.get("differentiable")
        or any(rebuilder(p) is not None for p in g["params"])  # NOTE [sharded state]
        for g in optimizer.param_groups
    )


def _state_tensors_per_element(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """How many tensors the size of a parameter a known optimizer keeps for it (its class's
    ``_init_group``); -1: an optimizer this does not know."""
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return int(group.get("momentum", 0) != 0)
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return 2 + int(bool(group.get("amsgrad")))
    if kind is torch.optim.RMSprop:
        return 1 + int(group.get("momentum", 0) > 0) + int(bool(group.get("centered")))
    if kind is torch.optim.Adagrad:
        return 1
    if kind in (torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam):
        return 2
    return -1


def first_step_floor(optimizer: torch.optim.Optimizer) -> tuple[int, int, int | None]:
    """Bytes the measuring step holds at its ``optimizer.step()`` at the least: (parameters,
    their gradients, the optimizer state the step has made whole; None for an optimizer this
    does not know). State already made counts as it is.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(256))
        >>> first_step_floor(torch.optim.AdamW([w]))
        (1024, 1024, 2048)
    """
    params = grads = state = 0
    known = True
    for group in optimizer.param_groups:
        per_element = _state_tensors_per_element(optimizer, group)
        for p in group["params"]:
            nbytes = local_tensor(p).nbytes  # this rank's shard (FSDP2)
            params += nbytes
            if not p.requires_grad:
                continue
            grads += nbytes
            made = optimizer.state.get(p)
            if made:
                state += sum(
                    local_tensor(v).nbytes for v in made.values() if isinstance(v, torch.Tensor)
                )
            elif per_element < 0:
                known = False
            else:
                state += per_element * nbytes
    return params, grads, (state if known else None)


def per_parameter_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """The most bytes of state one parameter holds (what is read back for one update), and
    how many tensors of state are moved in all."""
    best = count = 0
    for values in optimizer.state.values():
        sizes = [v.nbytes for v in values.values() if _counted(v)]
        best = max(best, sum(sizes))
        count += len(sizes)
    return best, count


class StateStore:
    """Keeps ``optimizer``'s state in the next tier between updates (see the NOTE).

    Example:
        >>> lin = torch.nn.Linear(64, 64)
        >>> opt = torch.optim.AdamW(lin.parameters())
        >>> lin(torch.ones(2, 64)).sum().backward(); opt.step()
        >>> store = StateStore(opt)
        >>> store.spill(opt.state)
        >>> opt.state[lin.weight]["exp_avg"].device.type, store.spilled_bytes
        ('meta', 32768)
        >>> store.fetch(opt.state)
        >>> opt.state[lin.weight]["exp_avg"].device.type, store.spilled_bytes
        ('cpu', 0)
        >>> store.close()
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, offload_dir: str | None = None, known: bool = True
    ) -> None:
        self.optimizer = optimizer
        self.known = known
        self._offload_dir = offload_dir
        self._stores: dict[torch.device, Store] = {}
        self._spilled: dict[tuple[int, str], _Spilled] = {}
        self.enabled = False
        self.bytes_written = 0
        self.bytes_read = 0
        self.write_errors = 0
        self.off = ""  # why the state stays in memory from now on (NOTE [a full disk])
        self.row_block = 0  # > 0: tensors above it are written in row blocks of at most it
        self.block_updates = 0  # parameters updated block by block
        self._busy = False  # inside a block-by-block update: the optimizer's hooks stay out
        self.stepwise = False  # NOTE [a kept-gradient step one parameter at a time]
        self.stepping = False  # inside one parameter's step of a stepwise optimizer.step()
        self.stepwise_updates = 0
        self._set_aside: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._updated: list[torch.Tensor] = []  # by the stepwise step in progress
        self._was_spilled = False  # at the last state_dict() call
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_own_step),
            optimizer.register_state_dict_pre_hook(self._before_state_dict),
            optimizer.register_state_dict_post_hook(self._after_state_dict),
        ]

    @property
    def tier(self) -> str:
        """The tier the state goes to: ``"disk"`` below a CPU device, ``"host"`` below CUDA."""
        devices = {s.device for s in self._spilled.values()} or {
            p.device for g in self.optimizer.param_groups for p in g["params"]
        }
        return "host" if any(_below(d) == "host" for d in devices) else "disk"

    @property
    def spilled_bytes(self) -> int:
        """Bytes of state in the store now."""
        return sum(s.nbytes for s in self._spilled.values())

    def _store(self, device: torch.device) -> Store:
        store = self._stores.get(device)
        if store is None:
            store = self._stores[device] = make_store(device, self._offload_dir, True)
        return store

    def measure(self, device: torch.device) -> Bandwidth | None:
        """The store's bandwidth below ``device`` (to predict a step's transfer time); None
        when the tier cannot be written (``off`` says why: NOTE [a full disk])."""
        if self.off:
            return None
        try:
            store = make_store(device, self._offload_dir, reuse_files=False)
            try:
                return measure_store(store, device, 16 << 20)
            finally:
                store.close()
        except (OSError, ResidencyError) as exc:
            self.off = f"the {self.tier} tier cannot be written: {exc}"
            return None

    # -- moving --------------------------------------------------------------------------------

    def _current(self) -> dict[Any, Any]:
        """The state of the parameters the optimizer's current (maybe narrowed) groups update:
        those with a gradient (torch's optimizers leave the others' state alone), all of them
        for an optimizer ts.fit does not know."""
        state = self.optimizer.state
        every = not self.known
        out: dict[Any, Any] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                values = state.get(p)
                if values and (every or p.grad is not None):
                    out[p] = values
        return out

    def spill(self, state: dict[Any, Any] | None = None) -> None:
        """Write out the state of ``state``'s parameters (default: the current groups')."""
        for p, values in (self._current() if state is None else state).items():
            for key, value in list(values.items()):
                if not _spillable(value):
                    continue
                local, rebuild = local_tensor(value), rebuilder(value)  # NOTE [sharded state]
                store = self._store(local.device)
                storage = local.untyped_storage()
                ranges = None if rebuild is not None else _in_rows(value, self.row_block)
                copy = blocks = None
                if ranges is None:
                    copy = store.finish(storage, store.begin(storage))  # raises: stays resident
                else:
                    blocks = self._write_blocks(store, value, ranges)
                placeholder = placeholder_of(value, self._copy_of, (id(p), key))
                self._spilled[(id(p), key)] = _Spilled(
                    placeholder,
                    copy,
                    storage.nbytes(),
                    int(local.storage_offset()),
                    local.dtype,
                    local.device,
                    blocks,
                    rebuild,
                    tuple(local.shape),
                    tuple(local.stride()),
                )
                values[key] = placeholder
                self.bytes_written += storage.nbytes()

    def set_row_block(self, block: int) -> None:
        """Write tensors above ``block`` bytes in row blocks from now on (0: whole); what is
        out already is rewritten, one parameter at a time."""
        if block == self.row_block:
            return
        self.row_block = block
        for p, values in list(self.optimizer.state.items()):
            if any((id(p), key) in self._spilled for key in values):
                self.fetch({p: values})
                self.spill_or_warn({p: values})

    def _write_blocks(
        self, store: Store, value: torch.Tensor, ranges: list[tuple[int, int]]
    ) -> list[_Block]:
        blocks: list[_Block] = []
        try:
            for start, stop in ranges:
                rows = value[start:stop].clone()  # a storage of its own, one block's bytes
                storage = rows.untyped_storage()
                copy = store.finish(storage, store.begin(storage))
                blocks.append(_Block(start, stop, copy, storage.nbytes()))
        except BaseException:
            for block in blocks:
                store.release(block.copy)
            raise
        return blocks

    def _read_block(self, record: _Spilled, block: _Block) -> torch.Tensor:
        if block.kept is not None:
            return block.kept
        store = self._store(record.device)
        loaded = store.ready(store.read(block.copy, block.nbytes))
        shape = (block.stop - block.start, *record.placeholder.shape[1:])
        rows = torch.empty(0, dtype=record.dtype, device=record.device)
        rows.set_(loaded, 0, shape, torch.empty(shape, device="meta").stride())
        self.bytes_read += block.nbytes
        return rows

    def _release(self, record: _Spilled) -> None:
        store = self._store(record.device)
        if record.blocks is None:
            store.release(record.copy)
            return
        for block in record.blocks:
            if block.copy is not None:
                store.release(block.copy)
            block.copy = block.kept = None

    def fetch(
        self, state: dict[Any, Any] | None = None, skip: frozenset[str] = frozenset()
    ) -> None:
        """Read back the state of ``state``'s parameters (default: the current groups'), but
        for the keys in ``skip``."""
        for p, values in (self._current() if state is None else state).items():
            for key, value in list(values.items()):
                record = self._spilled.get((id(p), key))
                if record is None or key in skip:
                    continue
                if value is record.placeholder:
                    values[key] = self._read(record)
                    unown((values[key],))  # state, even when read back inside a scope
                del self._spilled[(id(p), key)]  # replaced (load_state_dict): a stale record
                self._release(record)

    def _read(self, record: _Spilled) -> torch.Tensor:
        value = record.placeholder
        if record.blocks is not None:
            whole = torch.empty(value.shape, dtype=record.dtype, device=record.device)
            for block in record.blocks:
                whole[block.start : block.stop].copy_(self._read_block(record, block))
            return whole
        store = self._store(record.device)
        loaded = store.ready(store.read(record.copy, record.nbytes))
        tensor = torch.empty(0, dtype=record.dtype, device=record.device)
        if record.rebuild is not None:  # NOTE [sharded state]
            tensor.set_(loaded, record.storage_offset, record.shape, record.stride)
            self.bytes_read += record.nbytes
            return record.rebuild(tensor)
        tensor.set_(loaded, record.storage_offset, value.shape, value.stride())
        self.bytes_read += record.nbytes
        return tensor

    def _copy_of(self, key: Any, placeholder: torch.Tensor) -> torch.Tensor | None:
        """A copy of the value ``placeholder`` stands for (NOTE [copies of state in the next
        tier], placeholders.py); None when it stands for nothing any more."""
        record = self._spilled.get(key)
        if record is None or record.placeholder is not placeholder:
            return None
        read = self.bytes_read
        try:
            return self._read(record)
        finally:
            self.bytes_read = read  # a copy of the user's, not a step's traffic

    def update_in_rows(self, p: torch.Tensor, step_one: Callable[[torch.Tensor], None]) -> bool:
        """Run ``p``'s update block by block when its state is written in row blocks
        (NOTE [updates in row blocks]); False when it is not (the caller updates it whole).

        ``step_one(rows)`` runs the optimizer's step for the one parameter ``rows``."""
        values = self.optimizer.state.get(p)
        if not self.enabled or self.row_block <= 0 or not values or p.grad is None:
            return False
        split: dict[str, _Spilled] = {}
        for key, value in values.items():
            record = self._spilled.get((id(p), key))
            if record is not None and record.blocks is not None and value is record.placeholder:
                split[key] = record
        if not split:
            return False
        bounds = [(b.start, b.stop) for b in next(iter(split.values())).blocks or ()]
        if any([(b.start, b.stop) for b in r.blocks or ()] != bounds for r in split.values()):
            return False
        self.fetch({p: values}, skip=frozenset(split))
        grad = p.grad
        last: dict[str, Any] = {}
        self._busy = True
        try:
            for i, (start, stop) in enumerate(bounds):
                rows = p.detach()[start:stop]
                rows.grad = grad[start:stop]
                part: dict[str, Any] = {}
                for key, value in values.items():
                    if key in split:
                        part[key] = self._read_block(split[key], split[key].blocks[i])  # type: ignore[index]
                    elif _per_element(value, p):
                        part[key] = value[start:stop]  # kept in memory: updated in place
                    elif isinstance(value, torch.Tensor):
                        part[key] = value.clone()  # each block starts from the same count
                    else:
                        part[key] = value
                self.optimizer.state[rows] = part
                try:
                    step_one(rows)
                finally:
                    del self.optimizer.state[rows]
                for key, record in split.items():
                    self._rewrite_block(record, record.blocks[i], part[key])  # type: ignore[index]
                for key, value in values.items():
                    if key in split or part[key] is value:
                        continue
                    if _per_element(value, p):
                        value[start:stop].copy_(part[key])  # the optimizer replaced the view
                    else:
                        last[key] = part[key]
        finally:
            self._busy = False
        values.update(last)
        self.block_updates += 1
        self.spill_or_warn({p: values})  # what was read back whole goes out again
        return True

    def _rewrite_block(self, record: _Spilled, block: _Block, rows: torch.Tensor) -> None:
        store = self._store(record.device)
        if block.copy is not None:
            store.release(block.copy)
            block.copy = None
        if rows.untyped_storage().nbytes() != rows.nbytes or not rows.is_contiguous():
            rows = rows.contiguous().clone()
        if self.off:  # the tier failed a write already: no more tries
            block.kept = rows
            return
        try:
            storage = rows.untyped_storage()
            block.copy, block.kept = store.finish(storage, store.begin(storage)), None
            self.bytes_written += block.nbytes
        except (OSError, ResidencyError) as exc:
            block.kept = rows
            self._warn(exc)

    def fetch_all(self) -> None:
        """Read back every parameter's state."""
        self.fetch(dict(self.optimizer.state))

    # -- the optimizer's hooks -----------------------------------------------------------------

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # torch's wrapper gives the hook its call's arguments, the optimizer first
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if self.stepwise and self.enabled and not (self.stepping or self._busy) and closure is None:
            self._step_each()
            return
        if self._spilled:
            self.fetch()

    def _step_each(self) -> None:
        """NOTE [a kept-gradient step one parameter at a time]."""
        opt = self.optimizer
        self._updated = []
        try:
            for group in list(opt.param_groups):
                for p in list(group["params"]):
                    if p.grad is None:
                        continue

                    def step_one(q: torch.Tensor, group: dict[str, Any] = group) -> None:
                        with narrowed(opt, q, group):
                            type(opt).step(opt)

                    self.stepping = True
                    try:
                        if not self.update_in_rows(p, step_one):
                            step_one(p)
                            self.spill_or_warn({p: opt.state.get(p, {})})
                    finally:
                        self.stepping = False
                    self._set_aside.append((p, p.grad))
                    self._updated.append(p)
                    p.grad = None
                    self.stepwise_updates += 1
        except BaseException:
            self._restore_gradients()
            raise

    def _after_own_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.stepping:
            self._restore_gradients()
            self._updated = []

    def abort(self) -> list[torch.Tensor]:
        """The step stopped half-way (an exception out of its ``optimizer.step()``, NOTE [an
        aborted step] in fit/abort.py): the gradients set aside are given back and the state
        read back goes out again. Returns the parameters a stepwise step updated before."""
        self._restore_gradients()
        updated, self._updated = self._updated, []
        self.after_step()
        return updated

    def _restore_gradients(self) -> None:
        while self._set_aside:
            p, grad = self._set_aside.pop()
            p.grad = grad

    def after_step(self) -> None:
        """Write out the state just updated (called after the optimizer's step, or after one
        parameter's step inside backward). A failed write warns and leaves that state resident
        (the update is done: raising out of ``optimizer.step()`` would invite a second one)."""
        if self.enabled and not self._busy:
            self.spill_or_warn(None)

    def spill_or_warn(self, state: dict[Any, Any] | None) -> None:
        """``spill(state)``; a failed write warns and leaves that state in memory, and so
        does every write after it (NOTE [a full disk])."""
        if self.off:
            return
        try:
            self.spill(state)
        except (OSError, ResidencyError) as exc:
            self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        self.write_errors += 1
        if self.off:
            return
        self.off = f"writing the optimizer state to the {self.tier} tier failed: {exc}"
        warnings.warn(
            f"tensorscope.fit: the optimizer state could not be written to the {self.tier} "
            f"tier ({exc}); it stays in memory (nothing is lost), and the step is decided "
            f"again with the optimizer state in memory",
            FitWarning,
            stacklevel=3,
        )

    def _before_state_dict(self, optimizer: Any) -> None:
        self._was_spilled = bool(self._spilled)
        self.fetch_all()

    def _after_state_dict(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        # the returned dict's per-parameter dicts are the optimizer's own: copy them, so that
        # writing the state out again leaves the caller's values whole
        state_dict["state"] = {k: dict(v) for k, v in state_dict["state"].items()}
        if self.enabled and self._was_spilled:
            self.spill_or_warn(dict(self.optimizer.state))
        return state_dict

    def disable(self) -> None:
        """Read everything back and stop writing state out."""
        self.enabled = False
        self.fetch_all()

    def close(self) -> None:
        """Read everything back, remove the hooks, free the store (idempotent)."""
        self.disable()
        while self._handles:
            self._handles.pop().remove()
        for store in self._stores.values():
            store.close()
        self._stores.clear()
