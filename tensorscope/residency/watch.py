"""Keeping a managed module managed when torch or its user changes the module's tensors.

After ``ts.manage(model)`` a module's tensors can be replaced in several ways, each of which
used to leave the new tensor silently unmanaged (ordinary memory, outside the budget):

- ``model.half()``, ``.to(dtype)``, ``.float()``, ``.double()``: ``Module._apply`` sets
  ``param.data`` (the setter of ``ManagedParameter``, managed.py), converts gradients with
  ``grad.data = ...`` and replaces ``module._buffers[name]`` directly;
- ``torch.nn.utils.parametrize``: ``original.set_(new)`` (an op: ``oppath.py`` hands the new
  storage over) and new parameters of a new ``ParametrizationList``;
- ``module.weight = nn.Parameter(...)``, ``register_buffer``, a new submodule
  (``resize_token_embeddings`` sets a new ``nn.Embedding``), ``load_state_dict(assign=True)``.

# NOTE [how changes are found]
# Torch's global registration hooks (``register_module_{parameter,buffer,module}_registration_
# hook``, public API) see every parameter, buffer and submodule assigned to a module; a module
# of a managed tree (``OWNERS``: every submodule of a managed module, with its name prefix) has
# the new tensors managed at once, under their names. ``Module._apply`` is wrapped (once, at the
# first ``ts.manage()``; the project already wraps ``Module.__setstate__``, ``_keepers.py``):
# after the outermost call returns, the handles of the managed modules it touched are refreshed
# (``handle.refresh()``: everything of the module not managed yet is). What none of these see —
# a library writing ``module._parameters[name]`` itself — ``handle.refresh()`` manages when
# called, and ``audit()`` at every optimizer step (it costs one lookup per parameter). A tensor
# that cannot be managed (on the meta device, another device, not dense) is left in ordinary
# memory with a ``ResidencyWarning`` naming it; a sharded one (FSDP2's ``DTensor``) raises
# ``ResidencyError``: the whole model would silently leave the budget.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from tensorscope._torch import storage_address

if TYPE_CHECKING:
    from tensorscope.residency.manager import ResidencyManager
    from tensorscope.residency.placement import Placement

__all__ = [
    "Handle",
    "alias_made",
    "applying",
    "audit",
    "before_data_change",
    "data_replaced",
    "install",
    "track",
    "untrack",
]


class Handle(Protocol):
    """What this module asks of a ``ts.manage()`` handle (``ManagedModule``)."""

    manager: ResidencyManager

    @property
    def module(self) -> nn.Module: ...

    @property
    def removed(self) -> bool: ...

    def adopt(self, tensor: torch.Tensor, name: str, settle: bool = True) -> bool:
        """Manage ``tensor``, found under ``name`` of the module (idempotent)."""
        ...

    def readopt(self, tensor: torch.Tensor, old: Placement, settle: bool) -> None:
        """``tensor``'s storage replaced the one ``old`` manages: manage the new one."""
        ...

    def refresh(self) -> list[str]:
        """Manage every tensor of the module that is not managed yet."""
        ...

    def complete(self) -> bool:
        """Whether every parameter of the module is managed (or was refused already)."""
        ...


# Every submodule of a managed module -> (its handle, its name prefix in the managed module).
OWNERS: weakref.WeakKeyDictionary[nn.Module, tuple[Handle, str]] = weakref.WeakKeyDictionary()
HANDLES: weakref.WeakSet[Any] = weakref.WeakSet()  # live handles (Handle is a Protocol)
_local = threading.local()  # depth of Module._apply calls on this thread
_installed: list[bool] = []


def applying() -> bool:
    """Whether this thread is inside ``Module._apply`` (its handles refresh when it ends)."""
    return bool(getattr(_local, "depth", 0))


def track(handle: Handle) -> None:
    """Watch ``handle``'s module tree (at ``ts.manage()``)."""
    HANDLES.add(handle)
    for name, sub in handle.module.named_modules(remove_duplicate=False):
        OWNERS[sub] = (handle, f"{name}." if name else "")


def untrack(handle: Handle) -> None:
    """Stop watching ``handle``'s modules (at ``remove()``)."""
    HANDLES.discard(handle)
    for sub in [m for m, (h, _) in list(OWNERS.items()) if h is handle]:
        OWNERS.pop(sub, None)


def before_data_change(tensor: torch.Tensor) -> tuple[Handle, Placement] | None:
    """The handle and placement managing ``tensor``'s storage now, before it is replaced."""
    if tensor.layout is not torch.strided:
        return None
    for handle in list(HANDLES):
        placement = handle.manager.placement_of(tensor)
        if placement is not None and placement.owner is not None and placement.owner() is handle:
            return handle, placement
    return None


def data_replaced(tensor: torch.Tensor, before: tuple[Handle, Placement] | None) -> None:
    """``tensor``'s storage was replaced (``.data = ...``, ``set_()``): manage the new one."""
    if before is None:
        return
    handle, old = before
    if tensor.layout is torch.strided and storage_address(tensor) == old.key:
        return  # the same storage (``.to()`` to where it already is)
    if not handle.removed:
        handle.readopt(tensor, old, settle=not applying())


def alias_made(param: torch.Tensor, alias: torch.Tensor) -> None:
    """``nn.Parameter(param)`` made ``alias`` (managed.py): it gets its plain class back with
    ``param``'s."""
    before = before_data_change(param)
    if before is not None:
        before[1].restore.append((weakref.ref(alias), nn.Parameter))


def audit() -> None:
    """At each optimizer step: refresh the handles whose modules have a parameter that no hook
    saw arrive (written into ``module._parameters`` directly: FSDP2's ``fully_shard`` after
    ``ts.manage()``, some loaders). One parameter lookup per parameter when nothing changed."""
    for handle in list(HANDLES):
        if not handle.removed and not handle.complete():
            handle.refresh()


# ----------------------------------------------------------------------------------- hooks
def _adopt_tree(handle: Handle, module: nn.Module, prefix: str) -> None:
    for name, sub in module.named_modules(remove_duplicate=False, prefix=prefix):
        OWNERS[sub] = (handle, f"{name}.")
    for name, param in module.named_parameters(prefix=prefix, remove_duplicate=False):
        handle.adopt(param, name)
    for name, buffer in module.named_buffers(prefix=prefix, remove_duplicate=False):
        handle.adopt(buffer, name)


def _on_tensor(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    entry = OWNERS.get(module)
    if entry is not None and tensor is not None and not entry[0].removed:
        entry[0].adopt(tensor, entry[1] + name)


def _on_module(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    entry = OWNERS.get(module)
    if entry is not None and submodule is not None and not entry[0].removed:
        _adopt_tree(entry[0], submodule, entry[1] + name)


def _refresh_touched(module: nn.Module) -> None:
    handles: dict[int, Handle] = {}
    for sub in module.modules():
        entry = OWNERS.get(sub)
        if entry is not None:
            handles.setdefault(id(entry[0]), entry[0])
    for handle in handles.values():
        if not handle.removed:
            handle.refresh()


def install() -> None:
    """Wrap ``Module._apply`` and register the registration hooks (once per process)."""
    if _installed:
        return
    _installed.append(True)
    original: Any = nn.Module._apply

    @functools.wraps(original)
    def _apply(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.depth = depth
            if depth == 0 and OWNERS:
                _refresh_touched(self)

    nn.Module._apply = _apply  # type: ignore[method-assign]
    module_hooks.register_module_parameter_registration_hook(_on_tensor)
    module_hooks.register_module_buffer_registration_hook(_on_tensor)
    module_hooks.register_module_module_registration_hook(_on_module)
