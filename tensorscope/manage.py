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
from types import TracebackType
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from tensorscope._intercept import activate_residency, deactivate_residency
from tensorscope._state import ThreadData, thread_data
from tensorscope._torch import plain_repr
from tensorscope.errors import ArgumentTypeError, ResidencyError
from tensorscope.ref import ResidencyMethods
from tensorscope.residency import ResidencyManager, residency

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


class ManagedModule:
    """The handle ``ts.manage(module)`` returns: ``remove()`` (or leave a ``with`` block)."""

    def __init__(self, module: nn.Module, manager: ResidencyManager, thread: ThreadData) -> None:
        self.module = module
        self._manager = manager
        self._thread = thread
        self._tensors: list[tuple[torch.Tensor, type[torch.Tensor]]] = []
        self._groups: set[int] = set()
        self._removed = False

    def _add(self, tensor: torch.Tensor, role: str) -> None:
        manager = self._manager
        if manager.placement_of(tensor) is None:
            # Make room first: the accounted peak stays within the budget from the start
            # (demoting what was registered before this tensor).
            with manager._lock:
                nbytes = tensor.untyped_storage().nbytes()
                if manager.budget_bytes is not None and nbytes <= manager.budget_bytes:
                    manager._make_room(nbytes, "ts.manage()")
        placement = manager.register(tensor, role=role)
        if manager.budget_bytes is not None and placement.nbytes > manager.budget_bytes:
            manager._demote(placement)  # larger than the whole budget: it lives below
        self._groups.add(placement.uid)
        original = type(tensor)
        if original is nn.Parameter:
            tensor.__class__ = ManagedParameter
        elif original is torch.Tensor:
            tensor.__class__ = ManagedBuffer
        self._tensors.append((tensor, original))

    @property
    def removed(self) -> bool:
        return self._removed

    def remove(self) -> None:
        """Plain parameters and buffers again, holding their current values. Idempotent."""
        if self._removed:
            return
        self._removed = True
        manager = self._manager
        with manager._lock:
            for placement in list(manager._placements.values()):
                if placement.uid in self._groups or placement.group in self._groups:
                    manager.unregister(placement)
            manager._sweep()
        for tensor, original in self._tensors:
            tensor.__class__ = original
        self._tensors.clear()
        deactivate_residency(self._thread)

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
        state = "removed" if self._removed else f"{len(self._tensors)} tensors"
        return f"<ManagedModule {type(self.module).__name__}: {state}>"


def manage(module: nn.Module, *, manager: ResidencyManager | None = None) -> ManagedModule:
    """Put ``module``'s parameters and buffers under the residency manager, in place.

    They start on the device tier; what does not fit the budget is demoted at once. Under a
    budget on a CPU device every one of them moves into the disk tier's files (those that fit
    stay mapped, resident), so their heap memory is released now. Use the
    module from the thread that called ``manage`` (its ops are intercepted there; on a CPU device
    other threads still read correct data, only unaccounted).

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
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(
            f"tensorscope.residency: ts.manage() takes an nn.Module; got {type(module).__name__}."
        )
    manager = manager or residency
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if tensor.device.type != manager.device.type:
            raise ResidencyError(
                f"tensorscope.residency: {name} is on {tensor.device} but the device tier is "
                f"{manager.device}; call module.to({str(manager.device)!r}) first or configure "
                "ts.residency's device."
            )
    data = thread_data()
    activate_residency(data, manager)  # held by the handle until remove()
    handle = ManagedModule(module, manager, data)
    manager._handles.add(handle)
    try:
        for name, param in module.named_parameters():
            handle._add(param, f"param:{name}")
        for name, buffer in module.named_buffers():
            handle._add(buffer, f"buffer:{name}")
        with manager._lock:
            manager._make_room(0, "ts.manage()")
            # Under a budget on a CPU device, the weights that stay resident move into the disk
            # tier's files too (still mapped): all of their old heap memory goes back to the OS
            # now, rather than during the first forward, interleaved with activations.
            if manager.budget_bytes is not None:
                manager.back_with_files(handle._groups)
            manager.release_heap(threshold=0)
        manager.flush_disk()  # their copies reach the disk now, not during the first steps
    except BaseException:
        handle.remove()
        raise
    return handle
