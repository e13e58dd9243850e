"""``ts.manage(module)``: a module's parameters and buffers under the residency manager.

Parameters stay ``nn.Parameter``s (their class becomes the subclass :class:`ManagedParameter`,
which adds ``tier``/``promote()``/``demote()``), so modules, ``state_dict`` and optimizers see
nothing new; the optimizer's references, views and autograd's saved tensors keep their identity
whatever tier the data is on. Gradients and optimizer state created for managed parameters are
managed too (see residency.py). ``handle.remove()`` gives back plain parameters holding their
current values.
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref
from types import TracebackType

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from typing_extensions import Self

from tensorscope.errors import ArgumentTypeError, ResidencyError, ResidencyWarning
from tensorscope.loading import Loaded, load_checkpoint
from tensorscope.residency import ResidencyManager, config, residency, watch
from tensorscope.residency.managed import PLAIN_CLASS, ManagedBuffer, ManagedParameter
from tensorscope.residency.placement import Placement

__all__ = ["ManagedBuffer", "ManagedModule", "ManagedParameter", "manage"]


class ManagedModule:
    """The handle ``ts.manage(module)`` returns: ``remove()`` (or leave a ``with`` block), and
    ``refresh()``.

    The module stays managed when its tensors change: ``model.half()``/``.to(dtype)``, a new
    ``nn.Parameter`` or buffer assigned, a new submodule (``resize_token_embeddings``), a
    parametrization: the new tensors are managed under their names at once (residency/watch.py).
    """

    _ids = itertools.count(1)

    def __init__(self, module: nn.Module, manager: ResidencyManager) -> None:
        # NOTE [the handle does not keep the module alive]
        # watch.py keeps every handle (its OWNERS map: a weak key per submodule, the handle as
        # value) so that a handle the user dropped (``ts.manage(model)`` without keeping the
        # result) still watches its module. The handle holds the module weakly: dropping the
        # model frees it, its handle and (by the sweep) its placements, as before.
        self._module = weakref.ref(module)
        self.manager = manager
        self._id = next(self._ids)
        self._count = 0
        self._groups: set[int] = set()
        self._removed = False
        self._refused: set[int] = set()  # ids of tensors named in a warning already
        self._seen: list[tuple[weakref.ref[nn.Module], list[tuple[str, int]]]] = []

    def _add(self, tensor: torch.Tensor, name: str) -> Placement:
        # Roles name a tensor across iterations (Flow's predictions); the handle's id keeps two
        # models with the same parameter names apart.
        placement = self.manager.manage_tensor(tensor, (self._id, name))
        self._adopt(tensor, placement)
        return placement

    def _adopt(self, tensor: torch.Tensor, placement: Placement) -> None:
        self._groups.add(placement.uid)
        placement.owner = weakref.ref(self)
        self._switch_class(tensor, placement)
        self._count += 1

    @staticmethod
    def _switch_class(tensor: torch.Tensor, placement: Placement) -> None:
        original = PLAIN_CLASS.get(type(tensor), type(tensor))
        if original is nn.Parameter:
            tensor.__class__ = ManagedParameter
        elif original is torch.Tensor:
            tensor.__class__ = ManagedBuffer
        # The manager gives the class back when it stops managing the tensor (remove(), or
        # ts.residency.reset() after the handle was dropped).
        if not any(ref() is tensor for ref, _ in placement.restore):
            placement.restore.append((weakref.ref(tensor), original))

    # ------------------------------------------------------------------- changes after manage
    def adopt(self, tensor: torch.Tensor, name: str, settle: bool = True) -> bool:
        """Manage ``tensor``, found under ``name`` of the module after ``ts.manage()`` (a new
        parameter, buffer or submodule); whether it is managed now. One that cannot be managed
        stays in ordinary memory, with a ``ResidencyWarning`` naming it."""
        if self._removed:
            return False
        placement = self.manager.placement_of(tensor)
        if placement is not None:  # a tied weight, an alias: its storage is managed already
            owner = placement.owner() if placement.owner is not None else None
            if owner is None:  # e.g. made by an op in a scope (model.half() in a scope)
                self.manager.claim(placement, (self._id, name))
                self._adopt(tensor, placement)
            else:
                self._switch_class(tensor, placement)
            return True
        problem = unmanageable(tensor, self.manager)
        if problem is not None:
            self._refuse(tensor, name, problem)
            return False
        placement = self._add(tensor, name)
        if settle:
            self.manager.settle({placement.uid}, whole=False)
        return True

    def _refuse(self, tensor: torch.Tensor, name: str, problem: str) -> None:
        """A tensor of the module that cannot be managed: a sharded one (a ``DTensor``) raises,
        any other is named once in a ``ResidencyWarning``."""
        if is_traceable_wrapper_subclass(tensor):
            raise ResidencyError(
                f"tensorscope.residency: {name} of the managed module is now a "
                f"{type(tensor).__name__}: FSDP2's fully_shard or tensor parallelism replaced it "
                "after ts.manage(), and ts.manage() moves dense tensors only, so the module is "
                "no longer under the budget. Call handle.remove() before sharding the model (a "
                "sharded model cannot be managed)."
            )
        if id(tensor) in self._refused:
            return
        self._refused.add(id(tensor))
        warnings.warn(
            f"tensorscope.residency: {name} of the managed module is {problem}, so it stays in "
            "ordinary memory, unmanaged (outside the budget). Move it to "
            f"{self.manager.device} (or give it a value) and call handle.refresh().",
            ResidencyWarning,
            stacklevel=4,
        )

    def complete(self) -> bool:
        """Whether the module's parameters are those seen when it was last managed or
        refreshed: what ``watch.audit()`` asks at each optimizer step, to find changes no hook
        saw (about 0.1 µs per parameter: the modules' parameter dicts against a snapshot)."""
        for ref, seen in self._seen:
            module = ref()
            if module is None:
                continue
            parameters = module._parameters
            if len(parameters) != len(seen):
                return False
            for name, ident in seen:
                if id(parameters.get(name)) != ident:
                    return False
        return True

    def snapshot(self) -> None:
        """Remember every module's parameters as they are now (see ``complete``): weakly, by
        identity, so that the snapshot keeps neither the modules nor their parameters alive."""
        root = self._module()
        self._seen = [
            (weakref.ref(module), [(name, id(p)) for name, p in module._parameters.items()])
            for module in (root.modules() if root is not None else ())
        ]

    def readopt(self, tensor: torch.Tensor, old: Placement, settle: bool) -> None:
        """``tensor``'s data was replaced (``.data = ...``, ``set_()``, ``module.half()``):
        the new storage is managed under the old one's name; the old one goes once nothing
        else holds it."""
        name = old.role[1] if isinstance(old.role, tuple) else str(old.role)
        # The old storage is let go first (its room counts for the new one), without giving
        # ``tensor`` its plain class back: it stays managed.
        old.restore = [(ref, cls) for ref, cls in old.restore if ref() is not tensor]
        self.manager.storages_disposed([old.key])
        self.adopt(tensor, name, settle=settle)

    def refresh(self) -> list[str]:
        """Manage every parameter, buffer and gradient of the module not managed yet (one
        replaced without torch's registration hooks, e.g. by writing
        ``module._parameters[name]``); returns the names newly managed.

        Example:
            >>> import torch, tensorscope as ts
            >>> model = torch.nn.Linear(4, 4)
            >>> handle = ts.manage(model)
            >>> model._parameters["bias"] = torch.nn.Parameter(torch.zeros(4))  # no hook sees it
            >>> handle.refresh()
            ['bias']
            >>> handle.remove()
        """
        if self._removed or self._module() is None:
            return []
        manager = self.manager
        manager.storages_disposed([])  # what the changes left behind frees room first
        found: list[str] = []
        before = set(self._groups)
        module = self.module
        watch.track(self)
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]
        for name, tensor in named:
            managed = manager.placement_of(tensor) is not None
            if self.adopt(tensor, name, settle=False) and not managed:
                found.append(name)
        for param in module.parameters():
            grad = param.grad
            placement = manager.placement_of(param)
            if grad is not None and placement is not None and unmanageable(grad, manager) is None:
                manager.manage_tensor(grad, None, group=placement.uid)
        manager.settle(self._groups - before)
        self.snapshot()
        return found

    @property
    def module(self) -> nn.Module:
        """The managed module.

        Raises:
            ResidencyError: the module was freed (the handle does not keep it alive).
        """
        module = self._module()
        if module is None:
            raise ResidencyError(
                "tensorscope.residency: the module of this ts.manage() handle was freed; "
                "keep a reference to the model as long as you use its handle."
            )
        return module

    @property
    def removed(self) -> bool:
        return self._removed

    def remove(self) -> None:
        """Plain parameters and buffers again, holding their current values. Idempotent.

        The values come back into ordinary memory: this needs the memory of the whole module.
        """
        if self._removed:
            return
        self.manager.unmanage(self._groups)  # raises for lost bytes: then call it again later
        self._removed = True
        watch.untrack(self)

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
        module = self._module()
        name = type(module).__name__ if module is not None else "(freed)"
        return f"<ManagedModule {name}: {state}>"


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
    config.check_storage_door()
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
            nothing (unless ``strict=False``), other shapes, a truncated or corrupt file; torch
            older than 2.13 without tensorscope's C++ module ``_storage`` (nothing could move).

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
        if is_traceable_wrapper_subclass(tensor):
            _release_loaded(manager, loaded)
            raise ResidencyError(
                f"tensorscope.residency: {name} is a {type(tensor).__name__}, a tensor subclass "
                "wrapping others (FSDP2's fully_shard and tensor parallelism make DTensors); "
                "ts.manage() moves dense tensors only. Manage the model without sharding it, "
                "or shard it without ts.manage() (docs/residency.md, Limits)."
            )
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
    watch.install()  # the module stays managed when its tensors change (watch.py)
    watch.track(handle)
    handle.snapshot()
    return handle


def unmanageable(tensor: torch.Tensor, manager: ResidencyManager) -> str | None:
    """Why ``tensor`` cannot be managed (for messages: "on the meta device"), or None."""
    if is_traceable_wrapper_subclass(tensor):
        return f"a {type(tensor).__name__} (a tensor subclass wrapping others)"
    if tensor.layout is not torch.strided:
        return f"not dense ({tensor.layout})"
    if tensor.device.type == "meta":
        return "on the meta device"
    if tensor.device.type != manager.device.type:
        return f"on {tensor.device}, not on the device tier ({manager.device})"
    return None


def _release_loaded(manager: ResidencyManager, loaded: list[Loaded]) -> None:
    """A check failed after tensors were placed from the checkpoint: stop managing them."""
    manager.unmanage({item.placement.uid for item in loaded})
