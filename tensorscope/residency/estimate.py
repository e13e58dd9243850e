"""What an op on managed tensors will allocate: its results' sizes, from a run on the meta
device, learned per op signature (the manager reserves room for them before the op runs).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

from tensorscope._torch import no_dispatch, storage_address

__all__ = ["Estimates", "call", "result_sizes", "tensors", "to_meta"]

_META_CACHE_LIMIT = 4096  # op signatures whose result sizes are remembered
_FIRST_RUN_SLACK = 512  # bytes beyond the meta estimate until a run taught the real size


def tensors(args: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors among an op's arguments (and in its list arguments)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    yield item


def call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """Run an ``OpOverload`` as the dispatcher would (without ``OpOverload.__call__``)."""
    return func._op(*args, **kwargs) if kwargs else func._op(*args)


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


_META = torch.device("meta")


def to_meta(value: Any) -> Any:
    """The op's arguments on the meta device (a ``device=`` argument too: ``_to_copy``)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(
            tuple(value.shape), value.stride(), dtype=value.dtype, device="meta"
        )
    if isinstance(value, torch.device):
        return _META
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(v) for v in value)
    return value


def result_sizes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int] | None:
    """Bytes of each fresh result tensor of ``func`` (a meta run); None without a meta kernel."""
    try:
        meta_args = to_meta(args)
        meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
        inputs = {storage_address(t) for t in tensors((*meta_args, *meta_kwargs.values()))}
        with no_dispatch(), torch.no_grad():
            out = call(func, meta_args, meta_kwargs)
    except Exception:  # no meta kernel: accounted after the op instead
        return None
    flat = out if isinstance(out, (list, tuple)) else (out,)
    sizes = []
    for item in flat:
        group = item if isinstance(item, (list, tuple)) else (item,)
        for tensor in group:
            if isinstance(tensor, torch.Tensor) and storage_address(tensor) not in inputs:
                sizes.append(tensor.untyped_storage().nbytes())
            else:
                sizes.append(0)
    return sizes


class Estimates:
    """Result sizes per op signature (see the NOTE on result sizes)."""

    def __init__(self) -> None:
        self.cache: dict[Hashable, tuple[int, bool]] = {}  # bytes, learned from a run

    def clear(self) -> None:
        self.cache.clear()

    def estimate(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[int, int, Hashable | None]:
        """Bytes of fresh results ``func`` will allocate (slack included), the slack, and the
        op's signature.

        # NOTE [result sizes]
        # A meta run gives the sizes; some CPU kernels allocate more than their meta kernel
        # (``mse_loss``'s 0-d result has a 128-byte storage, its meta one 4 bytes). So the bytes
        # actually made are learned per signature after each run (``learn``), and until then
        # the estimate carries a little slack: the budget stays a hard limit.
        """
        try:
            key: Hashable = (func, _signature(args), _signature(kwargs))
        except _Uncacheable:
            nbytes = sum(result_sizes(func, args, kwargs) or ())
            return nbytes + _FIRST_RUN_SLACK, _FIRST_RUN_SLACK, None
        cached = self.cache.get(key)
        if cached is None:
            cached = (sum(result_sizes(func, args, kwargs) or ()), False)
            if len(self.cache) >= _META_CACHE_LIMIT:
                self.cache.clear()  # shapes changed a lot: start afresh
            self.cache[key] = cached
        nbytes, learned = cached
        slack = 0 if learned else _FIRST_RUN_SLACK
        return nbytes + slack, slack, key

    def learn(self, signature: Hashable | None, made: int) -> None:
        if signature is None:
            return
        cached = self.cache.get(signature)
        if cached is not None:
            self.cache[signature] = (max(cached[0], made), True)
