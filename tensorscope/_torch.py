"""Typed doors to the few torch internals tensorscope relies on (checked on torch 2.13).

Keeping them here gives one place to adapt when torch changes, and keeps ``mypy --strict``
honest everywhere else.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "cuda_event",
    "cuda_stream",
    "new_storage",
    "plain_repr",
    "storage_address",
    "storage_use_count",
    "swap_data_ptr",
]

_C: Any = torch._C
_storage_address = _C._storage_address
_storage_use_count = _C._storage_Use_Count
_tensor_repr: Any = torch.Tensor.__repr__
_UntypedStorage: Any = torch.UntypedStorage


def storage_address(tensor: torch.Tensor) -> int:
    """Address of the tensor's ``StorageImpl``: the same for every alias of the storage."""
    return int(_storage_address(tensor))


def storage_use_count(address: int) -> int:
    """Strong references to the ``StorageImpl`` at ``address`` (keep one alive while asking)."""
    return int(_storage_use_count(address))


def new_storage(nbytes: int, device: torch.device | str = "cpu") -> torch.UntypedStorage:
    """A fresh ``UntypedStorage`` of ``nbytes`` on ``device``."""
    storage: torch.UntypedStorage = _UntypedStorage(nbytes, device=device)
    return storage


def swap_data_ptr(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages (equal sizes, or one of them empty)."""
    swap: Any = storage._swap_data_ptr_  # type: ignore[attr-defined]
    swap(other)


def plain_repr(tensor: torch.Tensor) -> str:
    """``repr`` of a tensor as torch prints a plain ``torch.Tensor``."""
    return str(_tensor_repr(tensor))


def cuda_stream(device: torch.device) -> torch.cuda.Stream:
    """A new CUDA stream on ``device`` (for copies that overlap compute)."""
    stream: torch.cuda.Stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def cuda_event() -> torch.cuda.Event:
    """A new CUDA event (recorded after a copy; waited on before its data is used)."""
    event: torch.cuda.Event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    return event
