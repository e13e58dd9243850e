"""``ts.manage(module)``: a module's parameters and buffers under the residency manager.

Parameters stay ``nn.Parameter``s (their class becomes the subclass :class:`ManagedParameter`,
which adds ``tier``/``promote()``/``demote()``), so modules, ``state_dict`` and optimizers see
nothing new; the optimizer's references, views and autograd's saved tensors keep their identity
whatever tier the data is on. Gradients and optimizer state created for managed parameters are
managed too (see residency.py). ``handle.remove()`` gives back plain parameters holding their
current values.
"""

from __future__ import annotations

import copy
import itertools
import os
import warnings
import weakref
from types import TracebackType
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from tensorscope._torch import plain_repr, treat_as_plain_for_tracing
from tensorscope.errors import ArgumentTypeError, ResidencyError, ResidencyWarning
from tensorscope.loading import Loaded, load_checkpoint
from tensorscope.ref import ResidencyMethods
from tensorscope.residency import ResidencyManager, residency
from tensorscope.residency.placement import Placement

__all__ = ["ManagedBuffer", "ManagedModule", "ManagedParameter", "manage"]


class ManagedParameter(ResidencyMethods, nn.Parameter):
    """An ``nn.Parameter`` whose data the residency manager moves between tiers."""

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return "Parameter containing:\n" + plain_repr(self.data)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        result = nn.Parameter(self.data.clone(), self.requires_grad)
        memo[id(self)] = result
        return result

    def __reduce_ex__(self, proto: Any) -> Any:  # pickles as a plain Parameter
        rebuild = torch._utils._rebuild_parameter
        return (rebuild, (self.data, self.requires_grad, {}))


class ManagedBuffer(ResidencyMethods, torch.Tensor):
    """A module buffer whose data the residency manager moves between tiers."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return plain_repr(self.data)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return copy.deepcopy(self.data, memo)

    def __reduce_ex__(self, proto: Any) -> Any:
        return torch.Tensor._reduce_ex_internal(self.data, proto)  # type: ignore[no-untyped-call]


# Compiled code (AOTAutograd) is given managed parameters and buffers as it is given plain ones.
treat_as_plain_for_tracing(ManagedParameter)
treat_as_plain_for_tracing(ManagedBuffer)


class ManagedModule:
    """The handle ``ts.manage(module)`` returns: ``remove()`` (or leave a ``with`` block)."""

    _ids = itertools.count(1)

    def __init__(self, module: nn.Module, manager: ResidencyManager) -> None:
        self.module = module
        self._manager = manager
        self._id = next(self._ids)
        self._count = 0
        self._groups: set[int] = set()
        self._removed = False

    def _add(self, tensor: torch.Tensor, name: str) -> None:
        # Roles name a tensor across iterations (Flow's predictions); the handle's id keeps two
        # models with the same parameter names apart.
        self._adopt(tensor, self._manager.manage_tensor(tensor, (self._id, name)))

    def _adopt(self, tensor: torch.Tensor, placement: Placement) -> None:
        self._groups.add(placement.uid)
        original = type(tensor)
        if original is nn.Parameter:
            tensor.__class__ = ManagedParameter
        elif original is torch.Tensor:
            tensor.__class__ = ManagedBuffer
        # The manager gives the class back when it stops managing the tensor (remove(), or
        # ts.residency.reset() after the handle was dropped).
        placement.restore = (weakref.ref(tensor), original)
        self._count += 1

    @property
    def removed(self) -> bool:
        return self._removed

    def remove(self) -> None:
        """Plain parameters and buffers again, holding their current values. Idempotent.

        The values come back into ordinary memory: this needs the memory of the whole module.
        """
        if self._removed:
            return
        self._manager.unmanage(self._groups)  # raises for lost bytes: then call it again later
        self._removed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{self._count} tensors"
        return f"<ManagedModule {type(self.module).__name__}: {state}>"


def _check_module(module: object, manager: object) -> tuple[nn.Module, ResidencyManager]:
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(
            f"tensorscope.residency: ts.manage() takes an nn.Module; got {type(module).__name__}."
        )
    if manager is None:
        manager = residency
    if not isinstance(manager, ResidencyManager):
        raise ArgumentTypeError(
            "tensorscope.residency: manager= must be a ts.ResidencyManager (or None for "
            f"ts.residency); got {type(manager).__name__}."
        )
    return module, manager


def manage(
    module: nn.Module,
    *,
    manager: ResidencyManager | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    strict: bool = True,
) -> ManagedModule:
    """Put ``module``'s parameters and buffers under the residency manager, in place.

    They start on the device tier; what does not fit the budget is demoted at once. Under a
    budget on a CPU device every one of them moves into the disk tier's files (those that fit
    stay mapped, resident), so their heap memory is released now. Ops on them are run through
    the manager on the thread that called ``manage`` and on every thread with a scope open.
    Buffers that are not dense (sparse) stay in ordinary memory, with a ``ResidencyWarning``.

    With ``checkpoint`` (one ``.safetensors`` file, or a directory with ``model.safetensors`` or
    ``model.safetensors.index.json``), the module's meta tensors (built under
    ``ts.empty_init()``) take their values from it: headers only are read, and a stored tensor of
    the parameter's dtype is placed on the disk tier *in the checkpoint file itself* (never
    written: a tensor that is written first gets its own offload file); another dtype is
    converted once into an offload file. Create optimizers after this call: the meta parameters
    are replaced by new ones.

    Raises:
        ArgumentTypeError: ``module`` is not an ``nn.Module``, or ``manager`` is not a manager.
        ResidencyError: a tensor is on another device than the device tier, on ``meta`` without
            a checkpoint, or already managed by another ``ts.manage()`` handle (remove that one
            first); with ``checkpoint``: meta tensors it has no value for, keys that match
            nothing (unless ``strict=False``), other shapes, a truncated or corrupt file.

    Example:
        >>> import torch, tensorscope as ts
        >>> ts.residency.configure(device="cpu", policy="flow", budget="1.5MiB")
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        >>> handle = ts.manage(model)  # 2 MiB of weights: one weight fits
        >>> [layer.weight.tier for layer in model]
        ['disk', 'device']
        >>> model(torch.ones(1, 512)).shape
        torch.Size([1, 512])
        >>> handle.remove(); type(model[0].weight).__name__
        'Parameter'
    """
    module, manager = _check_module(module, manager)
    handle = ManagedModule(module, manager)
    loaded = []
    if checkpoint is not None:
        loaded = load_checkpoint(module, checkpoint, strict, manager, handle._id)
    placed = {id(item.tensor) for item in loaded}
    tensors = [
        (name, tensor)
        for name, tensor in (*module.named_parameters(), *module.named_buffers())
        if id(tensor) not in placed
    ]
    dense = []
    sparse = []
    for name, tensor in tensors:
        if tensor.layout is not torch.strided:
            sparse.append(name)
            continue
        if tensor.device.type == "meta":
            _release_loaded(manager, loaded)
            raise ResidencyError(
                f"tensorscope.residency: {name} is on the meta device (built under "
                "ts.empty_init()?) and has no value; pass checkpoint=... to give it its stored "
                "value, or build the module with real parameters."
            )
        if tensor.device.type != manager.device.type:
            _release_loaded(manager, loaded)
            raise ResidencyError(
                f"tensorscope.residency: {name} is on {tensor.device} but the device tier is "
                f"{manager.device}; call module.to({str(manager.device)!r}) first or configure "
                "ts.residency's device."
            )
        if isinstance(tensor, (ManagedParameter, ManagedBuffer)):
            _release_loaded(manager, loaded)
            raise ResidencyError(
                f"tensorscope.residency: {name} is already managed by another ts.manage() "
                "handle; call that handle's remove() first (a module is managed once)."
            )
        dense.append((name, tensor))
    if sparse:
        warnings.warn(
            f"tensorscope.residency: {len(sparse)} non-dense tensor(s) of the module stay in "
            f"ordinary memory, unmanaged ({', '.join(sparse[:5])}): only dense tensors can "
            "move between tiers.",
            ResidencyWarning,
            stacklevel=2,
        )
    manager.add_handle(handle)
    try:
        for item in loaded:
            handle._adopt(item.tensor, item.placement)
        for name, tensor in dense:
            handle._add(tensor, name)
        manager.settle(handle._groups)
    except BaseException:
        handle.remove()
        raise
    return handle


def _release_loaded(manager: ResidencyManager, loaded: list[Loaded]) -> None:
    """A check failed after tensors were placed from the checkpoint: stop managing them."""
    manager.unmanage({item.placement.uid for item in loaded})
