"""The classes of managed parameters and buffers, and what happens when their data is replaced.

``ts.manage()`` switches a module's parameters to :class:`ManagedParameter` (an ``nn.Parameter``
subclass adding ``tier``/``promote()``/``demote()``) and its buffers to :class:`ManagedBuffer`.
Both are plain tensors in all but name: no ``__torch_function__``, no ``__torch_dispatch__``.

# NOTE [a managed parameter whose data is replaced]
# ``module.half()``, ``.to(dtype)``, ``.float()`` (``Module._apply``) and user code set
# ``param.data = converted``: the parameter object stays, its storage is a new one, which
# nothing managed. The ``data`` setter of these classes hands the new storage to the handle
# that managed the old one (``watch.data_replaced``): same name, same handle, budget enforced
# at once. ``_apply`` also converts gradients (``grad.data = ...``) and replaces buffers in
# ``module._buffers`` directly, which no setter sees: ``watch.py`` refreshes the handle after
# the outermost ``_apply`` returns.
#
# NOTE [nn.Parameter(managed)]
# ``torch.nn.utils.parametrize`` (``weight_norm``, custom parametrizations) wraps the original
# parameter again: ``nn.Parameter(p)``. For a subclass, torch requires ``p.detach()`` to return
# the same class, and makes that detached alias the new parameter. Everywhere else ``detach()``
# must stay autograd's plain detach (``state_dict()`` calls it). So ``detach()`` returns a
# ``ManagedParameter`` alias only when its caller is ``nn.Parameter.__new__`` (one frame
# lookup): the new parameter shares the storage, so it *is* managed, by the same placement, and
# gets its plain class back with the original one.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn

from tensorscope._torch import no_dispatch, plain_repr, treat_as_plain_for_tracing
from tensorscope.ref import ResidencyMethods

__all__ = ["PLAIN_CLASS", "ManagedBuffer", "ManagedParameter"]

_DATA: Any = torch._C.TensorBase.data
_DETACH: Any = torch.Tensor.detach
_PARAMETER_NEW = nn.Parameter.__new__.__code__


def _set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    from tensorscope.residency import watch

    before = watch.before_data_change(tensor)
    _DATA.__set__(tensor, value)
    watch.data_replaced(tensor, before)


class ManagedParameter(ResidencyMethods, nn.Parameter):
    """An ``nn.Parameter`` whose data the residency manager moves between tiers."""

    @property
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)  # type: ignore[no-any-return]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _set_data(self, value)

    def detach(self) -> torch.Tensor:
        """Autograd's ``detach()``; a managed alias for ``nn.Parameter(self)`` (see the NOTE)."""
        if sys._getframe(1).f_code is not _PARAMETER_NEW:
            return _DETACH(self)  # type: ignore[no-any-return]
        with no_dispatch():  # an alias, owned by no scope
            alias: torch.Tensor = _DETACH(self)
        alias.__class__ = ManagedParameter
        from tensorscope.residency import watch

        watch.alias_made(self, alias)
        return alias

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

    @property
    def data(self) -> torch.Tensor:
        return _DATA.__get__(self)  # type: ignore[no-any-return]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _set_data(self, value)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return plain_repr(self.data)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return copy.deepcopy(self.data, memo)

    def __reduce_ex__(self, proto: Any) -> Any:
        return torch.Tensor._reduce_ex_internal(self.data, proto)  # type: ignore[no-untyped-call]


# The class a managed tensor had before ts.manage() (and gets back when it stops being managed).
PLAIN_CLASS: dict[type, type[torch.Tensor]] = {
    ManagedParameter: nn.Parameter,
    ManagedBuffer: torch.Tensor,
}

# Compiled code (AOTAutograd) is given managed parameters and buffers as it is given plain ones.
treat_as_plain_for_tracing(ManagedParameter)
treat_as_plain_for_tracing(ManagedBuffer)
