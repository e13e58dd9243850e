"""Optimizer state in the next tier between updates: each parameter's state (AdamW's two moments)
is written out after its update and read back just before the next one. See NOTE [optimizer
state between updates].
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from tensorscope.errors import FitWarning, ResidencyError
from tensorscope.fit.offload_rules import Bandwidth
from tensorscope.fit.offload_store import Store, make_store, measure_store

__all__ = ["MIN_SPILL_BYTES", "StateStore", "per_parameter_state_bytes"]

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

MIN_SPILL_BYTES = 4096


@dataclass
class _Spilled:
    placeholder: torch.Tensor
    copy: Any
    nbytes: int
    storage_offset: int
    dtype: torch.dtype
    device: torch.device


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
        self._was_spilled = False  # at the last state_dict() call
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_state_dict_pre_hook(self._before_state_dict),
            optimizer.register_state_dict_post_hook(self._after_state_dict),
        ]

    @property
    def tier(self) -> str:
        """The tier the state goes to: ``"disk"`` below a CPU device, ``"host"`` below CUDA."""
        devices = {s.device for s in self._spilled.values()} or {
            p.device for g in self.optimizer.param_groups for p in g["params"]
        }
        return "host" if any(d.type == "cuda" for d in devices) else "disk"

    @property
    def spilled_bytes(self) -> int:
        """Bytes of state in the store now."""
        return sum(s.nbytes for s in self._spilled.values())

    def _store(self, device: torch.device) -> Store:
        store = self._stores.get(device)
        if store is None:
            store = self._stores[device] = make_store(device, self._offload_dir, True)
        return store

    def measure(self, device: torch.device) -> Bandwidth:
        """The store's bandwidth below ``device`` (to predict a step's transfer time)."""
        store = make_store(device, self._offload_dir, reuse_files=False)
        try:
            return measure_store(store, device, 16 << 20)
        finally:
            store.close()

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
                storage = value.untyped_storage()
                store = self._store(value.device)
                copy = store.finish(storage, store.begin(storage))  # raises: stays resident
                placeholder = torch.empty_strided(
                    value.shape, value.stride(), dtype=value.dtype, device="meta"
                )
                self._spilled[(id(p), key)] = _Spilled(
                    placeholder,
                    copy,
                    storage.nbytes(),
                    value.storage_offset(),
                    value.dtype,
                    value.device,
                )
                values[key] = placeholder
                self.bytes_written += storage.nbytes()

    def fetch(self, state: dict[Any, Any] | None = None) -> None:
        """Read back the state of ``state``'s parameters (default: the current groups')."""
        for p, values in (self._current() if state is None else state).items():
            for key, value in list(values.items()):
                record = self._spilled.get((id(p), key))
                if record is None:
                    continue
                store = self._store(record.device)
                if value is record.placeholder:
                    loaded = store.ready(store.read(record.copy, record.nbytes))
                    tensor = torch.empty(0, dtype=record.dtype, device=record.device)
                    tensor.set_(loaded, record.storage_offset, value.shape, value.stride())
                    values[key] = tensor
                    self.bytes_read += record.nbytes
                del self._spilled[(id(p), key)]  # replaced (load_state_dict): a stale record
                store.release(record.copy)

    def fetch_all(self) -> None:
        """Read back every parameter's state."""
        self.fetch(dict(self.optimizer.state))

    # -- the optimizer's hooks -----------------------------------------------------------------

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._spilled:
            self.fetch()

    def after_step(self) -> None:
        """Write out the state just updated (called after the optimizer's step, or after one
        parameter's step inside backward). A failed write warns and leaves that state resident
        (the update is done: raising out of ``optimizer.step()`` would invite a second one)."""
        if self.enabled:
            self._spill_or_warn(None)

    def _spill_or_warn(self, state: dict[Any, Any] | None) -> None:
        try:
            self.spill(state)
        except (OSError, ResidencyError) as exc:
            self.write_errors += 1
            warnings.warn(
                f"tensorscope.fit: the optimizer state could not be written to the {self.tier} "
                f"tier ({exc}); it stays in memory for this step (above the plan's peak)",
                FitWarning,
                stacklevel=2,
            )

    def _before_state_dict(self, optimizer: Any) -> None:
        self._was_spilled = bool(self._spilled)
        self.fetch_all()

    def _after_state_dict(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        # the returned dict's per-parameter dicts are the optimizer's own: copy them, so that
        # writing the state out again leaves the caller's values whole
        state_dict["state"] = {k: dict(v) for k, v in state_dict["state"].items()}
        if self.enabled and self._was_spilled:
            self._spill_or_warn(dict(self.optimizer.state))
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
