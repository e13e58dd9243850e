"""Typed doors to torch.distributed's data-parallel wrappers: FSDP2 (``fully_shard``), FSDP1 and
DDP -- which modules they wrap, what storages FSDP2 holds, its groups' unshard and reshard
(checked on torch 2.13). Layer 3: imports torch only, and torch.distributed's modules only once
the user imported them (``sys.modules``): a process that never shards pays nothing.

# NOTE [what FSDP2 holds]
# Per parameter (an ``FSDPParam`` of the module's ``FSDPParamGroup``): the sharded parameter, a
# ``DTensor`` whose local tensor is this rank's shard (``sharded_parameter``); the unsharded
# parameter, a plain ``nn.Parameter`` viewing ``all_gather_outputs[0]``, whose storage FSDP2
# frees with ``storage.resize_(0)`` after each use and reallocates with ``resize_`` before the
# next (``unsharded_parameter``); in flight, the flat all-gather buffer of the group
# (``fsdp::all_gather_copy_in``'s output, written by ``c10d::_allgather_base_``), kept until the
# next group's copy-out in forward, and the reduce-scatter input (``c10d::_reduce_scatter_base_``'s
# input, ``reduce_scatter``), kept until the next group's reduce-scatter. Their identities are
# read from FSDP2's own objects, never guessed from shapes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "SHARD_ROLES",
    "dtensor_class",
    "fsdp1_modules",
    "fsdp2_modules",
    "is_ddp",
    "is_fsdp2",
    "local_tensor",
    "rebuilder",
    "replicated_too",
    "reshard",
    "shard_storages",
    "sharded_parameters",
    "unshard",
    "unsharded",
]

#: What the recorder calls what FSDP2 holds (NOTE [what FSDP2 holds]).
SHARD_ROLES = ("sharded_parameter", "unsharded_parameter", "reduce_scatter")


def _attr(module: str, name: str) -> Any:
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def dtensor_class() -> type | None:
    """``DTensor``, once ``torch.distributed.tensor`` was imported (else None)."""
    found = _attr("torch.distributed.tensor", "DTensor")
    return found if isinstance(found, type) else None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a ``DTensor``; any other tensor as it is."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def rebuilder(tensor: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For a ``DTensor``: a function making a ``DTensor`` like it from a local tensor like its
    own (FSDP2's optimizer state read back from the next tier); None for any other tensor."""
    cls = dtensor_class()
    if cls is None or not isinstance(tensor, cls):
        return None
    spec: Any = tensor._spec  # type: ignore[attr-defined]
    mesh, placements = spec.mesh, spec.placements
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())

    def rebuild(local: torch.Tensor) -> torch.Tensor:
        made: torch.Tensor = cls.from_local(  # type: ignore[attr-defined]
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )
        return made

    return rebuild


def is_fsdp2(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    cls = _attr("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and isinstance(module, cls)


def fsdp2_modules(root: nn.Module) -> list[nn.Module]:
    """The modules under ``root`` (itself included) that ``fully_shard`` was applied to."""
    if _attr("torch.distributed.fsdp", "FSDPModule") is None:
        return []
    return [m for m in root.modules() if is_fsdp2(m)]


def fsdp1_modules(root: nn.Module) -> list[nn.Module]:
    """The ``FullyShardedDataParallel`` (FSDP1) wrappers under ``root`` (itself included)."""
    cls = _attr("torch.distributed.fsdp", "FullyShardedDataParallel")
    if cls is None:
        return []
    return [m for m in root.modules() if isinstance(m, cls)]


def is_ddp(module: nn.Module) -> bool:
    """Whether ``module`` is a ``DistributedDataParallel`` wrapper."""
    cls = _attr("torch.nn.parallel", "DistributedDataParallel")
    return cls is not None and isinstance(module, cls)


def _groups(module: nn.Module) -> list[Any]:
    state = module._get_fsdp_state()  # type: ignore[operator]
    return list(getattr(state, "_fsdp_param_groups", ()))


def _params(module: nn.Module) -> Iterator[Any]:
    for group in _groups(module):
        yield from group.fsdp_params


def sharded_parameters(root: nn.Module) -> list[torch.Tensor]:
    """The sharded parameters (``DTensor``s) of the FSDP2 modules under ``root``: what the
    optimizer must hold."""
    return [param.sharded_param for m in fsdp2_modules(root) for param in _params(m)]


def replicated_too(root: nn.Module) -> bool:
    """Whether an FSDP2 group under ``root`` also replicates (HSDP: a 2-D mesh, gradients
    all-reduced across replicas after the reduce-scatter)."""
    return any(bool(group._is_hsdp) for m in fsdp2_modules(root) for group in _groups(m))


def unsharded(module: nn.Module) -> bool:
    """Whether the FSDP2 module's parameters are unsharded and registered on it now (a gather
    still in flight, a backward prefetch, is not: ``unshard()`` waits for it)."""
    return all(group.is_unsharded for group in _groups(module))


def unshard(module: nn.Module) -> None:
    """All-gather the FSDP2 module's parameters and register them on it (a collective)."""
    module.unshard()  # type: ignore[operator]


def reshard(module: nn.Module) -> None:
    """Free the FSDP2 module's unsharded parameters; register the sharded ones again."""
    module.reshard()  # type: ignore[operator]


def shard_storages(root: nn.Module) -> dict[int, tuple[str, str]]:
    """``id(storage) -> (role, name)`` for what the FSDP2 modules under ``root`` hold
    persistently: each parameter's shard and its unsharded parameter's storages (NOTE [what
    FSDP2 holds]); names are the parameters' names in ``root``."""
    found: dict[int, tuple[str, str]] = {}
    names = {id(p): n for n, p in root.named_parameters(remove_duplicate=False)}
    for module in fsdp2_modules(root):
        for param in _params(module):
            sharded = param.sharded_param
            name = names.get(id(sharded), str(getattr(param, "_param_fqn", "")))
            found[id(local_tensor(sharded).untyped_storage())] = ("sharded_parameter", name)
            gathered = [*getattr(param, "all_gather_outputs", ())]
            gathered += [*getattr(param, "_unsharded_inner_tensors", ())]
            if hasattr(param, "_unsharded_param"):
                gathered.append(local_tensor(param._unsharded_param))
            for tensor in gathered:
                found[id(tensor.untyped_storage())] = ("unsharded_parameter", name)
    return found
