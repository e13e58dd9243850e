"""Typed doors to the few torch internals tensorscope relies on (checked on torch 2.13 and 2.11).

Keeping them here gives one place to adapt when torch changes, and keeps ``mypy --strict``
honest everywhere else. Layer 3: imports torch and the engine (layer 2) only.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, TypeVar, cast

import torch

from tensorscope._engine import FAST

__all__ = [
    "ACCUMULATE_GRAD",
    "ORIGINAL_FROMBUFFER",
    "SCOPE_KEY",
    "STORAGE_DOOR",
    "caller_of_disabled",
    "compiler_disabled",
    "cuda_event",
    "cuda_stream",
    "current_autograd_node",
    "graph_task_id",
    "is_parameter_like",
    "jit_optimize",
    "mode_on_top",
    "new_storage",
    "no_dispatch",
    "no_subclass_function",
    "plain_alias",
    "plain_repr",
    "poison_versions",
    "pop_mode",
    "push_mode",
    "scope_key_included",
    "set_scope_key_included",
    "storage_address",
    "storage_door_missing",
    "storage_use_count",
    "swap_data_ptr",
    "tensor_over",
    "tracing",
    "treat_as_plain_for_tracing",
]

_C: Any = torch._C
_storage_address = _C._storage_address
_storage_use_count = _C._storage_Use_Count
_tensor_repr: Any = torch.Tensor.__repr__
_UntypedStorage: Any = torch.UntypedStorage
_set_version_counter: Any = _C._autograd._unsafe_set_version_counter

_F = TypeVar("_F", bound=Callable[..., Any])


def compiler_disabled(fn: _F) -> _F:
    """``fn`` run as it is when compiled code reaches it: Dynamo breaks its graph there instead
    of tracing it (``torch.compiler.disable``)."""
    disable: Any = torch.compiler.disable
    return cast(_F, disable(fn))


_DYNAMO_SOURCES = os.path.join(os.path.dirname(torch.__file__), "_dynamo") + os.sep


def caller_of_disabled() -> FrameType:
    """The frame that called the (compiler-disabled) function calling this: Dynamo's wrapper
    frames between them are skipped."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_DYNAMO_SOURCES):
        frame = frame.f_back
    return frame


# torch.frombuffer as torch defines it (the interceptor wraps the public name; internal
# buffers, such as the disk tier's mappings, must not become refs).
ORIGINAL_FROMBUFFER = torch.frombuffer

no_subclass_function = _C.DisableTorchFunctionSubclass


def _find_scope_key() -> Any:
    """``DispatchKey.DeferredInit``, which torch's Python enum does not name (see _engine.py)."""
    for value in range(256):
        try:
            key = _C.DispatchKey(value)
        except (TypeError, ValueError):  # pragma: no cover - past the last key
            break
        if _C._dispatch_keyset_to_string(_C.DispatchKeySet(key)) == "DispatchKeySet(DeferredInit)":
            return key
    raise ImportError("tensorscope: this torch has no DeferredInit dispatch key")


# The key both scope engines own results on (csrc/fast.cpp, _pyengine.py): included on a
# thread while a scope is open there.
SCOPE_KEY: Any = _find_scope_key()
_set_included: Any = _C._dispatch_tls_set_dispatch_key_included
_is_included: Any = _C._dispatch_tls_is_dispatch_key_included


def set_scope_key_included(on: bool) -> None:
    """Include (or exclude) the scope engines' dispatch key on this thread."""
    _set_included(SCOPE_KEY, on)


def scope_key_included() -> bool:
    """Whether the scope engines' dispatch key is included on this thread."""
    return bool(_is_included(SCOPE_KEY))


class no_dispatch:
    """Run tensorscope's own tensor work unseen: no Python dispatch mode, and the scope
    engines' key excluded on this thread (its results must not become refs)."""

    __slots__ = ("_key", "_modes", "_native")

    def __enter__(self) -> None:
        self._modes = _C._DisableTorchDispatch()
        self._modes.__enter__()
        self._key = scope_key_included()
        if self._key:
            set_scope_key_included(False)
        # The C++ op path of the residency manager (csrc/managed.cpp) is off too.
        self._native = _NATIVE_OPS and not _res_excluded(True)

    def __exit__(self, *exc: object) -> None:
        if self._native:
            _res_excluded(False)
        if self._key:
            set_scope_key_included(True)
        self._modes.__exit__(*exc)


_NATIVE_OPS = FAST is not None and hasattr(FAST, "res_excluded")
_res_excluded: Any = FAST.res_excluded if _NATIVE_OPS else None


graph_task_id = _C._current_graph_task_id
current_autograd_node = _C._current_autograd_node
ACCUMULATE_GRAD: type = _C._functions.AccumulateGrad


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


# NOTE [the storage door]
# Residency gives a managed storage other memory in place (every tensor, view and saved copy
# sharing it follows). torch 2.13 has UntypedStorage._swap_data_ptr_ for that; torch 2.11 has
# no Python API that replaces a storage's memory (resize_ reallocates through the storage's own
# allocator, never onto a file mapping), so there tensorscope's small C++ module
# ``tensorscope._storage`` (csrc/storage.cpp, built beside the scope engine and loaded whatever
# TENSORSCOPE_ENGINE says) does the same through c10::StorageImpl's setters. Without either,
# the residency manager and fit's parameter placement refuse to start (``storage_door_missing``)
# rather than fail at the first move.
def _storage_door() -> tuple[str, Any]:
    if hasattr(_UntypedStorage, "_swap_data_ptr_"):
        return "torch", None
    try:
        module: Any = importlib.import_module("tensorscope._storage")
    except ImportError:
        return "", None
    return "extension", module.swap


STORAGE_DOOR, _extension_swap = _storage_door()


def storage_door_missing() -> str | None:
    """Why no storage's memory can be exchanged on this install (NOTE [the storage door]), or
    None when it can."""
    if STORAGE_DOOR:
        return None
    return (
        f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_ (torch 2.13 has) and "
        "tensorscope's C++ module tensorscope._storage is not built. Build it with a C++ "
        "compiler (`pip install -e .`, or `python setup.py build_ext --inplace` in a source "
        "tree), or use torch 2.13"
    )


def swap_data_ptr(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages (equal sizes, or one of them empty)."""
    if STORAGE_DOOR == "torch":
        swap: Any = storage._swap_data_ptr_  # type: ignore[attr-defined]
        swap(other)
    elif _extension_swap is not None:
        _extension_swap(storage, other)
    else:
        from tensorscope.errors import ResidencyError

        raise ResidencyError(
            f"tensorscope.residency: nothing can move between tiers: {storage_door_missing()}."
        )


def treat_as_plain_for_tracing(cls: type) -> None:
    """torch's tracing (make_fx, AOTAutograd's analysis of a compiled function) defers every
    tensor whose exact type is not in ``HANDLED_TYPES``, so compiled code given one fails. A
    class tensorscope switches tensors to (no ``__torch_function__``, no
    ``__torch_dispatch__``: the tensor is plain in all but name) is added to that tuple."""
    import sys

    from torch.fx.experimental import proxy_tensor

    if cls in proxy_tensor.HANDLED_TYPES:
        return
    handled = (*proxy_tensor.HANDLED_TYPES, cls)
    proxy_tensor.HANDLED_TYPES = handled  # type: ignore[assignment]
    runtime = sys.modules.get("torch._functorch._aot_autograd.runtime_wrappers")
    if runtime is not None:  # imported the tuple by name already
        runtime.HANDLED_TYPES = handled  # type: ignore[attr-defined]


def jit_optimize(enabled: bool) -> bool:
    """Turn TorchScript's graph optimisation on or off on this thread; the previous setting."""
    previous = bool(_C._get_graph_executor_optimize())
    _C._set_graph_executor_optimize(enabled)
    return previous


def tracing() -> bool:
    """Whether ``torch.jit.trace`` is recording on this thread."""
    return _C._get_tracing_state() is not None


def poison_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> list[bool]:
    """Set the version counters of tensors disposed together to poison values without changing
    the counter of a live alias; which were poisoned.

    A version counter is shared by a tensor, its views, its ``detach()`` aliases and autograd's
    saved copies of it, and all of them share its storage. Where every holder of the storage is
    in ``tensors``, the shared counter is set. Where a tensor not disposed with them also holds
    it, the C++ engine gives the disposed tensor a new poisoned counter of its own; without the
    engine it is left unpoisoned (Python cannot give a tensor a new counter)."""
    holders: dict[int, int] = {}
    addresses = [_storage_of(tensor) for tensor in tensors]
    for address in addresses:
        if address:
            holders[address] = holders.get(address, 0) + 1
    alone = [not a or storage_use_count(a) <= holders[a] for a in addresses]
    if FAST is not None:
        FAST.poison(tensors, versions, alone)
        return [True] * len(tensors)
    chosen = [(t, v) for t, v, ok in zip(tensors, versions, alone, strict=True) if ok]
    if chosen:
        _set_version_counter([t for t, _ in chosen], [v for _, v in chosen])
    return alone


def _storage_of(tensor: torch.Tensor) -> int:
    """The StorageImpl address of a strided tensor with memory, else 0."""
    if tensor.layout is not torch.strided or tensor.device.type == "meta":
        return 0
    return storage_address(tensor)


def tensor_over(
    storage: torch.UntypedStorage, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` and ``shape`` whose memory is ``storage``."""
    stride = []
    step = 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    with no_dispatch(), no_subclass_function():
        return torch.empty(0, dtype=dtype, device=storage.device).set_(
            storage, 0, tuple(shape), tuple(reversed(stride))
        )


def plain_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` sharing ``tensor``'s storage, made without any interception."""
    with no_dispatch(), no_subclass_function():
        return torch.Tensor.detach(tensor)


def plain_repr(tensor: torch.Tensor) -> str:
    """``repr`` of a tensor as torch prints a plain ``torch.Tensor``."""
    return str(_tensor_repr(tensor))


def mode_on_top(mode: object) -> bool:
    """Whether ``mode`` is the innermost TorchDispatchMode of this thread."""
    depth = _C._len_torch_dispatch_stack()
    return bool(depth > 0 and _C._get_dispatch_stack_at(depth - 1) is mode)


def push_mode(mode: object) -> None:
    """Push ``mode`` on this thread's dispatch mode stack (without the context manager)."""
    _C._push_on_torch_dispatch_stack(mode)


def pop_mode() -> None:
    """Pop this thread's innermost dispatch mode."""
    _C._pop_torch_dispatch_stack(None)


def cuda_stream(device: torch.device) -> torch.cuda.Stream:
    """A new CUDA stream on ``device`` (for copies that overlap compute)."""
    stream: torch.cuda.Stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def cuda_event() -> torch.cuda.Event:
    """A new CUDA event (recorded after a copy; waited on before its data is used)."""
    event: torch.cuda.Event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    return event


def is_parameter_like(tensor: torch.Tensor) -> bool:
    """A parameter (any leaf that requires grad), a view of one, or a cast of one."""
    if tensor.is_leaf:
        return tensor.requires_grad
    base = tensor._base
    if base is not None and base.is_leaf and base.requires_grad:
        return True
    node = tensor.grad_fn
    if node is not None and type(node).__name__ == "ToCopyBackward0":
        following = node.next_functions
        return bool(following) and type(following[0][0]).__name__ == "AccumulateGrad"
    return False
