"""The pack and unpack hooks of one group's forward, and the facts ``decide()`` is given.

``Group`` is the context manager ``ActivationOffloader.group()`` returns: it pushes
``saved_tensors_hooks`` whose pack hook describes each saved tensor (``SavedTensorFacts``), asks
``offload_rules.decide`` and either hands the storage to the engine or keeps the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from tensorscope._torch import is_parameter_like, no_dispatch, plain_alias
from tensorscope.fit.offload_engine import Engine, GroupRun, Packed
from tensorscope.fit.offload_rules import Decision, SavedTensorFacts, decide
from tensorscope.ref import TensorRef

__all__ = [
    "Group",
    "hooks_enabled",
    "is_parameter_like",
    "other_hooks",
    "storage_ptrs",
    "tensors_in",
    "unpack",
]

_PLAIN_TYPES = (torch.Tensor, TensorRef, nn.Parameter)


def hooks_enabled() -> bool:
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if enabled is None else bool(enabled())


def other_hooks() -> bool:
    """Whether saved-tensor hooks are active now (a checkpoint's, ``save_on_cpu``, ...)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def tensors_in(value: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0 and isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth - 1)


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    ptrs = set()
    for tensor in tensors:
        try:
            ptrs.add(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            continue
    ptrs.discard(0)
    return frozenset(ptrs)


def unpack(packed: Any) -> torch.Tensor:
    if isinstance(packed, Packed):
        with no_dispatch():  # a plain tensor, owned by no scope: autograd frees it
            return packed.entry.engine.unpack(packed)
    tensor: torch.Tensor = packed
    return tensor


class Group:
    """The context of one group's forward: the pack hooks pushed, its run recorded."""

    def __init__(
        self,
        engine: Engine,
        device: torch.device,
        min_bytes: int,
        group: int,
        context: frozenset[int],
    ) -> None:
        self._engine = engine
        self._device = device
        self._min_bytes = min_bytes
        self._context = context
        self.run = engine.new_run(group)
        self._hooks = saved_tensors_hooks(self._pack, unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        run = self.run
        run.saved_tensors += 1
        try:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            nbytes = storage.nbytes()
            supported = (
                type(tensor) in _PLAIN_TYPES
                and tensor.layout == torch.strided
                and tensor.device == self._device
                and not tensor.is_conj()
                and not tensor.is_neg()
                and not tensor.is_quantized
            )
        except (RuntimeError, NotImplementedError):  # no storage (a functional or fake tensor)
            ptr, nbytes, supported = 0, 0, False
        facts = SavedTensorFacts(
            storage_nbytes=nbytes,
            parameter=supported and is_parameter_like(tensor),
            context=ptr in self._context,
            supported=supported,
        )
        decision = decide(facts, self._min_bytes)
        if decision is Decision.OFFLOAD:
            packed = self._engine.pack(run, tensor, storage)
            if packed is not None:
                return packed
            decision = Decision.UNSUPPORTED  # closed meanwhile
        run.kept[decision.name] = run.kept.get(decision.name, 0) + nbytes
        if tensor.grad_fn is None:
            return tensor
        # An op's saved output returned as itself would make a cycle (its grad_fn is the node
        # that saves it): freed only by the garbage collector. A plain alias has no grad_fn.
        return plain_alias(tensor)

    def __enter__(self) -> GroupRun:
        self._hooks.__enter__()
        return self.run

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, traceback)
        engine = self._engine
        if engine.trim_heap and self.run.entries:
            engine.jobs.put(("trim",))
