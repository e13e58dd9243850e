"""The op path: what the interceptor calls around every op that touches managed tensors."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

from tensorscope._moving import Moving
from tensorscope._placement import Placement
from tensorscope._torch import storage_address
from tensorscope.policies import OpView

__all__ = ["OpPath"]

_SWEEP_EVERY = 64  # ops between sweeps of placements nothing else holds any more
_META_CACHE_LIMIT = 4096  # op signatures whose result sizes are remembered


def _tensors(args: Iterable[Any]) -> Iterable[torch.Tensor]:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    yield item


class _Uncacheable(Exception):
    """An argument that cannot be part of a cache key (the estimate is then not cached)."""


def _signature(value: Any) -> Hashable:
    """What decides an op's result sizes: tensor metadata and non-float arguments.

    Floats (a learning rate, a step size) never decide shapes and change every step: keeping
    their values would grow the cache without bound.
    """
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.device.type)
    if isinstance(value, float):
        return float
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    try:
        hash(value)
    except TypeError:
        raise _Uncacheable from None
    return value  # type: ignore[no-any-return]


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(
            tuple(value.shape), value.stride(), dtype=value.dtype, device="meta"
        )
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


class OpPath(Moving):
    """Make operands resident before an op; register its results and apply the policy after."""

    def operands(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[Placement]:
        """The distinct placements of the managed tensors among an op's arguments."""
        found: list[Placement] = []
        placements = self._placements
        address_of = storage_address
        for source in (args, kwargs.values()) if kwargs else (args,):
            for tensor in _tensors(source):
                if tensor.layout is not torch.strided or tensor.device.type == "meta":
                    continue
                placement = placements.get(address_of(tensor))
                if placement is not None and placement not in found:
                    found.append(placement)
        return found

    def before_op(self, func: Any, operands: list[Placement], results_nbytes: int) -> None:
        """Make the operands resident (and room for managed results) before ``func`` runs."""
        with self._lock:
            self.clock += 1
            self._since_sweep += 1
            if self._since_sweep >= _SWEEP_EVERY:
                self._sweep()
            name = str(func)
            total = sum(p.nbytes for p in operands) + results_nbytes
            self._check_fits(total, f"op {name} (operands and results)")
            self._busy = {p.uid for p in operands}
            missing = [p for p in operands if p.tier != "device"]
            self._make_room(sum(p.nbytes for p in missing) + results_nbytes, f"op {name}")
            movers = self._movers() if missing else None
            for placement in missing:
                assert movers is not None
                movers.check_readable(placement)
            for placement in missing:
                self._promote(placement)
            for placement in operands:
                placement.wait()
            iterations = self.recorder.iterations
            self.recorder.record(func, tuple(p.role for p in operands))
            if self.recorder.iterations != iterations:
                self._on_iteration_end()  # a repeated forward began a new iteration

    def after_op(
        self,
        func: Any,
        operands: list[Placement],
        out: Any,
        manage_results: bool,
        mutating: bool,
        group: int = 0,
    ) -> list[Placement]:
        """Register managed results, then apply the policy's demotions and prefetches."""
        with self._lock:
            clock = self.clock
            for placement in operands:
                placement.last_use = clock
                if mutating:
                    placement.written = True
            results: list[Placement] = []
            if manage_results:
                # Results belong with the parameter their first operand belongs to (a grad or
                # optimizer state goes away with its parameter on remove()).
                if not group and operands:
                    group = operands[0].group or operands[0].uid
                position = self.recorder.position
                for index, tensor in enumerate(
                    _tensors(out if isinstance(out, (list, tuple)) else (out,))
                ):
                    if tensor.layout is not torch.strided or tensor.numel() == 0:
                        continue
                    found = self._placements.get(storage_address(tensor))
                    if found is None:
                        placement = Placement(
                            tensor.untyped_storage(), ("new", position, index), group
                        )
                        placement.last_use = clock
                        self._add(placement)
                    else:
                        placement = found
                        if placement.group != group and placement not in operands:
                            placement.group = group  # e.g. an activation's storage became a .grad
                    results.append(placement)
            self._busy = {p.uid for p in operands} | {p.uid for p in results}
            try:
                budget = self._budget
                if budget is not None and self._bytes["device"] > budget:
                    self._make_room(0, f"op {func} (results)")  # estimate was short
                policy = self._policy
                wants = getattr(policy, "wants_snapshot_after_op", True)
                snapshot = self._snapshot(upcoming=True) if wants else None
                view = OpView(
                    str(func),
                    tuple(p.uid for p in operands),
                    tuple(p.uid for p in results),
                    snapshot,
                )
                self._busy = set()
                self._apply(policy.after_op(view))
            finally:
                self._busy = set()
            return results

    def estimate_results(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Bytes of fresh results ``func`` will allocate (meta run, cached per signature)."""
        try:
            key: Hashable = (func, _signature(args), _signature(kwargs))
        except _Uncacheable:
            return self._meta_run(func, args, kwargs)
        cached = self._meta_cache.get(key)
        if cached is None:
            cached = self._meta_run(func, args, kwargs)
            if len(self._meta_cache) >= _META_CACHE_LIMIT:
                self._meta_cache.clear()  # shapes changed a lot: start afresh
            self._meta_cache[key] = cached
        return cached

    @staticmethod
    def _meta_run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        try:
            meta_args = _to_meta(args)
            meta_kwargs = {k: _to_meta(v) for k, v in kwargs.items()}
            inputs = {storage_address(t) for t in _tensors((*meta_args, *meta_kwargs.values()))}
            with torch._C._DisableTorchDispatch(), torch.no_grad():
                out = func._op(*meta_args, **meta_kwargs)
        except Exception:  # no meta kernel: accounted after the op instead
            return 0
        total = 0
        for tensor in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
            if storage_address(tensor) not in inputs:
                total += tensor.untyped_storage().nbytes()
        return total

    def iteration_boundary(self) -> None:
        """End of an iteration (an optimizer step): the trace so far predicts the next one."""
        with self._lock:
            self.recorder.boundary()
            self._on_iteration_end()
