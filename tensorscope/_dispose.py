"""Disposing refs: release the memory now, make every later use raise.

# NOTE [how disposal frees memory safely]
# Disposing a ref (1) records its shape/dtype/owner for the error message, (2) switches its class
# to ``DisposedTensor``, whose every Python path raises ``DisposedTensorError``, and (3) points its
# TensorImpl at a fresh empty storage (``tensor.data = empty``). Step 3 drops this tensor's hold on
# the storage, which PyTorch frees by refcount as soon as nothing else holds it, and leaves behind a
# valid 0-element tensor, so C++ code that still reaches it (autograd accumulating into a disposed
# ``.grad``) gets a shape error, never a dangling pointer. ``storage.resize_(0)`` would free the
# bytes of every alias at once, including Parameters and views that must stay valid, and leaves
# tensors whose reads segfault. Anything else holding the storage (a live view, a Parameter made
# from the data, ``.numpy()``) keeps it alive: we free only what nobody else can still read.
# Autograd's saved copies are the one holder we manage ourselves (``_saved.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tensorscope import _saved
from tensorscope._state import DISPOSAL_LISTENERS, Disposal, RefState, state_of
from tensorscope._torch import storage_address
from tensorscope.ref import (
    DisposedTensor,
    TensorRef,
    _check_convertible,
    _no_dispatch,
    _no_subclass_function,
    ref,
)

__all__ = ["dispose", "dispose_states"]


def dispose_states(states: Iterable[RefState], reason: str) -> None:
    """Dispose every live, undisposed ref in ``states`` as one batch (see the NOTE above).

    ``reason`` completes the error text "was disposed ...". Autograd's saved aliases of the
    batch's storages are emptied too when nothing but tensorscope-managed tensors hold them.
    """
    batch: list[tuple[torch.Tensor, RefState]] = []
    refs_per_storage: dict[int, int] = {}
    one_ref: dict[int, torch.Tensor] = {}  # a tensor of each storage, to reach the storage
    for state in states:
        tensor = state()
        if tensor is None or state.disposal is not None:
            continue
        key = _storage_key(tensor)
        if key is not None:
            refs_per_storage[key] = refs_per_storage.get(key, 0) + 1
            one_ref.setdefault(key, tensor)
        _unlink_grads(tensor, state)
        owner = state.owner
        if owner is not None:
            if owner._owned.get(state.key) is state:
                del owner._owned[state.key]
            state.counters.disposed_in_scope += 1
        else:
            state.counters.disposed_outside_scope += 1
        state.owner = None
        state.disposal = Disposal(
            tuple(tensor.shape), tensor.dtype, getattr(owner, "name", None), reason, None
        )
        batch.append((tensor, state))
    # Exactly one Python storage object per key, and only where autograd holds aliases: the
    # use-count arithmetic of empty_unheld_aliases counts it.
    storages = {k: t.untyped_storage() for k, t in one_ref.items() if k in _saved.ALIASES}
    one_ref.clear()
    if storages:
        _saved.empty_unheld_aliases(
            storages, refs_per_storage, f"{reason} (autograd had saved it for backward)"
        )
        storages.clear()
    for tensor, _state in batch:
        _release(tensor)
        tensor.__class__ = DisposedTensor
    if DISPOSAL_LISTENERS and refs_per_storage:
        keys = list(refs_per_storage)
        for listener in DISPOSAL_LISTENERS:
            listener(keys)


def _storage_key(tensor: torch.Tensor) -> int | None:
    if tensor.layout is not torch.strided or tensor.device.type == "meta":
        return None
    try:
        return storage_address(tensor)
    except (RuntimeError, NotImplementedError):
        return None


def _unlink_grads(tensor: torch.Tensor, state: RefState) -> None:
    # Autograd writes into a leaf's .grad from C++; cut the link so a later backward makes a
    # fresh gradient instead of accumulating into a disposed one.
    if state.grad_of is not None:
        leaf = state.grad_of()
        if leaf is not None and type(leaf) is not DisposedTensor:
            with _no_subclass_function():
                if leaf.grad is tensor:
                    leaf.grad = None
    if tensor.is_leaf and tensor.requires_grad and tensor.grad is not None:
        tensor.grad = None


_EMPTIES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _release(tensor: torch.Tensor) -> None:
    """Drop this TensorImpl's hold on its storage and, when possible, on its autograd graph."""
    with _no_dispatch(), _no_subclass_function():
        if tensor.grad_fn is not None and not tensor._is_view():
            # A disposed output kept in a stray list would otherwise keep its whole graph
            # (and the activations saved in it) alive. Views cannot be detached in place.
            tensor.detach_()
        # Disposed tensors share one 0-byte storage per dtype and device: nothing can grow it
        # (every Python path raises; C++ paths reaching a disposed tensor fail on its shape).
        key = (tensor.dtype, tensor.device)
        empty = _EMPTIES.get(key)
        if empty is None:
            empty = _EMPTIES[key] = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        tensor.data = empty


def dispose(*tensors: torch.Tensor) -> None:
    """Dispose each tensor now (idempotent). Plain tensors are made refs first.

    Example:
        >>> import torch, tensorscope as ts
        >>> t = torch.ones(2)
        >>> ts.dispose(t); t.is_disposed
        True
    """
    states = []
    for tensor in tensors:
        if type(tensor) is DisposedTensor:
            continue
        if not isinstance(tensor, TensorRef):
            _check_convertible(tensor, "ts.dispose()")
            ref(tensor)
        state = state_of(tensor)
        if state is not None:
            states.append(state)
    dispose_states(states, reason="by ts.dispose()")
