"""Saved-tensor hooks: autograd's saved activations become tensors a scope can release.

# NOTE [why saved tensors are aliased]
# While a scope is open, our pack hook sees every tensor autograd saves for backward. A leaf
# (parameter, input, anything without grad_fn) is returned as is: nothing references its graph,
# and if it is a ref that gets disposed, unpack sees the DisposedTensor class and raises. A
# non-leaf is replaced by a ``SavedAlias`` holding a plain alias of its storage. Returning the
# tensor itself would close an uncollectable C++ cycle (tensor -> grad_fn -> saved variable ->
# tensor) and leak every graph that is never backwarded; autograd avoids that cycle the same
# way, with a shallow copy. The alias is registered by storage, so disposing a ref also empties
# the aliases autograd keeps of it, and a later backward through them raises
# DisposedTensorError (API.md §2) instead of silently keeping the memory. Aliases are emptied
# only when tensorscope can account for every holder of the storage: while a live tensor (say a
# view moved to the outer scope) still holds it, the alias stays valid and backward works.
# Saved tensors of refs that Python already dropped belong to their graph: they live and die
# with it, as in plain PyTorch (disposing the graph's owned outputs cuts the graph, ref.py).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tensorscope._sites import Site, format_site
from tensorscope._state import STORAGE_HOLDERS, Disposal, RefState, state_of
from tensorscope.ref import DisposedTensor, disposed_error, disposed_error_for, plain_alias

__all__ = ["SavedAlias", "empty_unheld_aliases", "pack", "unpack"]


class SavedAlias:
    """What autograd keeps for a saved non-leaf tensor while a scope is open."""

    __slots__ = ("__weakref__", "alias", "disposal", "key", "site")

    def __init__(self, alias: torch.Tensor, key: int, site: Site) -> None:
        self.alias = alias
        self.key = key
        self.site = site
        self.disposal: Disposal | None = None


class _Entry(weakref.ref):  # type: ignore[type-arg]
    __slots__ = ("key",)
    key: int


# storage key (StorageImpl address) -> {id(entry): entry} for the live, not yet emptied aliases
# of that storage. Weak: the registry must not keep autograd's saved tensors alive.
ALIASES: dict[int, dict[int, _Entry]] = {}


def _on_alias_death(entry: _Entry, _aliases: dict[int, dict[int, _Entry]] = ALIASES) -> None:
    entries = _aliases.get(entry.key)
    if entries is not None:
        entries.pop(id(entry), None)
        if not entries:
            del _aliases[entry.key]


def _register(saved: SavedAlias) -> None:
    entry = _Entry(saved, _on_alias_death)
    entry.key = saved.key
    entries = ALIASES.get(saved.key)
    if entries is None:
        ALIASES[saved.key] = {id(entry): entry}
    else:
        entries[id(entry)] = entry


def pack(tensor: torch.Tensor) -> Any:
    if tensor.is_leaf or tensor.layout is not torch.strided:
        return tensor
    alias = plain_alias(tensor)
    try:
        key = int(alias.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return alias
    state: RefState | None = state_of(tensor)
    saved = SavedAlias(alias, key, state.site if state is not None else None)
    _register(saved)
    return saved


def unpack(packed: Any) -> torch.Tensor:
    kind = type(packed)
    if kind is SavedAlias:
        if packed.disposal is not None:
            raise disposed_error_for(packed.disposal, format_site(packed.site))
        return packed.alias  # type: ignore[no-any-return]
    if kind is DisposedTensor:
        raise disposed_error(packed)
    return packed  # type: ignore[no-any-return]


def empty_unheld_aliases(
    storages: dict[int, torch.UntypedStorage], refs_per_storage: dict[int, int], reason: str
) -> list[int]:
    """Empty the aliases of each storage whose every holder is ours; return the other keys.

    Holders we account for: the refs being disposed (``refs_per_storage``), the aliases, and the
    one Python storage object per key in ``storages``. Any surplus in the storage's use count is
    a tensor we do not control, which may still read the data.
    """
    still_held: list[int] = []
    for key in storages:
        entries = ALIASES.get(key)
        if not entries:
            continue
        aliases = [saved for entry in list(entries.values()) if (saved := entry()) is not None]
        surplus = torch._C._storage_Use_Count(key) - 1 - refs_per_storage.get(key, 0)
        surplus -= sum(holders(key) for holders in STORAGE_HOLDERS)
        if surplus - len(aliases) > 0:
            still_held.append(key)
            continue
        del ALIASES[key]
        for saved in aliases:
            alias = saved.alias
            saved.disposal = Disposal(tuple(alias.shape), alias.dtype, None, reason, None)
            with torch._C._DisableTorchDispatch():
                alias.data = torch.empty(0, dtype=alias.dtype, device=alias.device)
    return still_held
