"""``ts.manage(module, checkpoint=...)``: a module's meta tensors get their values from a
safetensors checkpoint, straight into the residency tiers.

Everything is checked before anything changes: keys the module lacks (``strict``), meta tensors
the checkpoint lacks, shapes that differ. Then each meta parameter (and meta buffer) becomes a
new tensor whose memory is the checkpoint file itself (or, for another stored dtype, an offload
file holding the converted value), put back under every name it has (tied weights load once);
tensors that already have memory get the stored value copied in (as ``load_state_dict`` would).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tensorscope.errors import ResidencyError
from tensorscope.residency import ResidencyManager
from tensorscope.residency.checkpoint_files import StoredTensor, read_checkpoint
from tensorscope.residency.placement import Placement

__all__ = ["Loaded", "load_checkpoint"]

_SHOWN = 10  # names listed in an error message


@dataclass
class _Slot:
    """One tensor object of the module, with every name and place it has."""

    tensor: torch.Tensor
    is_param: bool
    names: list[str] = field(default_factory=list)
    places: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Loaded:
    """A tensor placed from the checkpoint, and its placement."""

    tensor: torch.Tensor
    placement: Placement


def _slots(module: nn.Module) -> list[_Slot]:
    slots: dict[int, _Slot] = {}
    for kind, named in (
        (True, module.named_parameters(remove_duplicate=False)),
        (False, module.named_buffers(remove_duplicate=False)),
    ):
        for name, tensor in named:
            slot = slots.setdefault(id(tensor), _Slot(tensor, kind))
            owner_name, _, attribute = name.rpartition(".")
            slot.names.append(name)
            slot.places.append((module.get_submodule(owner_name), attribute))
    return list(slots.values())


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    more = len(names) - _SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def _plan(
    module: nn.Module, stored: dict[str, StoredTensor], strict: bool, where: str
) -> list[tuple[_Slot, StoredTensor]]:
    slots = _slots(module)
    known = {name for slot in slots for name in slot.names}
    unexpected = sorted(set(stored) - known)
    if unexpected and strict:
        raise ResidencyError(
            f"tensorscope.residency: checkpoint {where} holds {len(unexpected)} tensor(s) that "
            f"match no parameter or buffer of the module: {_listed(unexpected)}. Pass "
            "strict=False to ignore them."
        )
    plan, missing, mismatched = [], [], []
    for slot in slots:
        key = next((name for name in slot.names if name in stored), None)
        if key is None:
            if slot.tensor.device.type == "meta":
                missing.append(slot.names[0])
            continue
        entry = stored[key]
        if tuple(slot.tensor.shape) != entry.shape:
            mismatched.append(f"{key} {entry.shape} vs {tuple(slot.tensor.shape)}")
            continue
        plan.append((slot, entry))
    if missing:
        raise ResidencyError(
            f"tensorscope.residency: {len(missing)} meta tensor(s) of the module have no value "
            f"in checkpoint {where}: {_listed(missing)}. Check that the checkpoint was saved "
            "from this model (its keys are the state_dict's names)."
        )
    if mismatched:
        raise ResidencyError(
            f"tensorscope.residency: {len(mismatched)} tensor(s) of checkpoint {where} do not "
            f"have the module's shape (stored vs module): {_listed(mismatched)}."
        )
    return plan


def load_checkpoint(
    module: nn.Module,
    checkpoint: str | os.PathLike[str],
    strict: bool,
    manager: ResidencyManager,
    role_prefix: Hashable,
) -> list[Loaded]:
    """Give ``module``'s meta tensors their stored values (see the module docstring); returns
    the tensors placed in the tiers. Headers only are read for meta tensors."""
    where = repr(os.fspath(checkpoint)) if isinstance(checkpoint, (str, os.PathLike)) else "?"
    stored = read_checkpoint(checkpoint)
    plan = _plan(module, stored, strict, where)
    loaded: list[Loaded] = []
    for slot, entry in plan:
        if slot.tensor.device.type != "meta":
            _copy_into(slot.tensor, entry)
            continue
        tensor, placement = manager.place_stored(
            entry, slot.tensor.dtype, (role_prefix, slot.names[0]), parameter=slot.is_param
        )
        if slot.is_param:
            param_class: Any = type(slot.tensor)  # nn.Parameter or a subclass of it
            new: torch.Tensor = param_class(tensor, requires_grad=slot.tensor.requires_grad)
        else:
            new = tensor
        for owner, attribute in slot.places:
            registry = owner._parameters if slot.is_param else owner._buffers
            registry[attribute] = new  # type: ignore[assignment]
        loaded.append(Loaded(new, placement))
    return loaded


def _copy_into(tensor: torch.Tensor, entry: StoredTensor) -> None:
    """A tensor that has memory gets the stored value copied in (as ``load_state_dict``)."""
    from safetensors import safe_open

    with safe_open(entry.path, framework="pt") as handle:
        value = handle.get_tensor(entry.key)
    with torch.no_grad():
        tensor.copy_(value)
