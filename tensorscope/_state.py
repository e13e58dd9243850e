"""Bookkeeping shared by refs, scopes and the interceptor: per-ref state, per-thread counters.

# NOTE [ref state lives beside the tensor, not in it]
# Every TensorRef has one ``RefState``: a weak reference to the tensor (so scopes never keep a
# temporary alive) carrying its owner, creation site and disposal record in slots. It is found by
# ``id(tensor)`` in ``STATES`` rather than stored in the tensor's ``__dict__``: that would cost a
# dict per tensor on the hot path, and ``copy.deepcopy``/``torch.save`` copy ``__dict__``. The
# weak reference's callback runs when the tensor's C++ object dies (torch keeps a tensor's Python
# object alive while C++ still holds the tensor), which is when a ref "freed by Python" counts as
# disposed (API.md §3).
#
# NOTE [safe holders of a storage]
# A storage may only be freed (``resize_(0)``) when nothing that could read it without going
# through our guards still references it. ``SAFE_HOLDERS[key]`` counts, per storage, the tensors we
# know are guarded: disposed refs that are still alive (every path raises) and the aliases our
# saved-tensor hook keeps for autograd (unpack checks the storage). Whoever frees compares the
# storage's use count with the holders it can vouch for; any other holder (a Parameter sharing the
# data, a plain view, numpy) keeps the memory alive. Counts are exact: each holder adds one when
# it becomes guarded and removes it when it dies, so a key is gone before its address is reused.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch

from tensorscope._sites import Site

if TYPE_CHECKING:
    from tensorscope._intercept import Interceptor
    from tensorscope.scope import DisposeScope as Owner  # refs are owned by dispose scopes

__all__ = [
    "CURRENT_SCOPE",
    "SAFE_HOLDERS",
    "STATES",
    "Counters",
    "Disposal",
    "RefState",
    "ThreadData",
    "hold_storage",
    "new_state",
    "release_storage",
    "state_of",
    "thread_data",
]


class Counters:
    """Mutable per-thread statistics (API.md §3); ``ts.stats()`` snapshots them."""

    __slots__ = (
        "attached",
        "created_in_scope",
        "created_outside_scope",
        "detached",
        "disposed_in_scope",
        "disposed_outside_scope",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.created_in_scope = 0
        self.created_outside_scope = 0
        self.disposed_in_scope = 0
        self.disposed_outside_scope = 0
        self.attached = 0
        self.detached = 0


class Disposal:
    """Why and where a ref was disposed, kept for the error raised on later use."""

    __slots__ = ("dtype", "held_key", "reason", "scope_name", "shape")

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        scope_name: str | None,
        reason: str,
        held_key: int | None,
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.scope_name = scope_name
        self.reason = reason
        self.held_key = held_key


class RefState(weakref.ref):  # type: ignore[type-arg]
    """Weak reference to a TensorRef plus everything tensorscope knows about it."""

    __slots__ = ("counters", "disposal", "grad_of", "key", "owner", "site")

    key: int
    owner: Owner | None
    site: Site
    counters: Counters
    disposal: Disposal | None
    grad_of: weakref.ref[torch.Tensor] | None


STATES: dict[int, RefState] = {}
SAFE_HOLDERS: dict[int, int] = {}
# Refs turned into Parameters/Buffers leave tensorscope but their death is still counted:
# their states are kept alive here (by id: a dead weak reference cannot be hashed).
CONVERTED: dict[int, RefState] = {}


def hold_storage(key: int) -> None:
    SAFE_HOLDERS[key] = SAFE_HOLDERS.get(key, 0) + 1


def release_storage(key: int, _holders: dict[int, int] = SAFE_HOLDERS) -> None:
    count = _holders.get(key, 0) - 1
    if count > 0:
        _holders[key] = count
    else:
        _holders.pop(key, None)


def _on_ref_death(
    state: RefState,
    _states: dict[int, RefState] = STATES,
    _converted: dict[int, RefState] = CONVERTED,
    _release: Any = release_storage,
) -> None:
    # Default arguments bind the globals: this also runs during interpreter shutdown.
    key = state.key
    if _states.get(key) is state:
        del _states[key]
    if _converted:
        _converted.pop(id(state), None)
    disposal = state.disposal
    if disposal is None:
        owner = state.owner
        if owner is not None:
            if owner._owned.get(key) is state:
                del owner._owned[key]
            state.counters.disposed_in_scope += 1
        else:
            state.counters.disposed_outside_scope += 1
    elif disposal.held_key is not None:
        _release(disposal.held_key)


def new_state(
    tensor: torch.Tensor, owner: Owner | None, site: Site, counters: Counters
) -> RefState:
    """Register ``tensor`` (already of class TensorRef) and return its state. Not the hot path."""
    state = RefState(tensor, _on_ref_death)
    key = id(tensor)
    state.key = key
    state.owner = owner
    state.site = site
    state.counters = counters
    state.disposal = None
    state.grad_of = None
    STATES[key] = state
    if owner is not None:
        owner._owned[key] = state
        counters.created_in_scope += 1
    else:
        counters.created_outside_scope += 1
    return state


def state_of(tensor: object) -> RefState | None:
    """The state of a TensorRef (live or disposed), ``None`` for anything else."""
    state = STATES.get(id(tensor))
    if state is not None and state() is tensor:
        return state
    return None


class ThreadData:
    """Per-thread: statistics, the interceptor, and how many open scopes of this thread use it."""

    __slots__ = (
        "backward_paused",
        "counters",
        "interceptor",
        "pushed",
        "suspended",
        "thread_id",
        "users",
    )

    def __init__(self) -> None:
        self.counters = Counters()
        self.interceptor: Interceptor | None = None
        self.users = 0
        self.pushed = False
        # Popped for the duration of an optimizer step (see _intercept's NOTE on optimizers).
        self.suspended = False
        # Popped for the duration of a ref's backward() (see _intercept's NOTE on backward).
        self.backward_paused = False
        self.thread_id = threading.get_ident()


class _Local(threading.local):
    def __init__(self) -> None:
        self.data = ThreadData()


_local = _Local()


def thread_data() -> ThreadData:
    """This thread's :class:`ThreadData`."""
    return _local.data


# The residency manager's view of storages, for disposal (ref.py) without importing it:
# how many references to a storage it holds itself, and a call after refs were disposed.
STORAGE_HOLDERS: list[Callable[[int], int]] = []
DISPOSAL_LISTENERS: list[Callable[[list[int]], None]] = []

# torch.frombuffer before the interceptor wraps it (internal buffers must not become refs).
ORIGINAL_FROMBUFFER = torch.frombuffer

# The innermost open scope of this thread / asyncio task (contextvars give both for free).
CURRENT_SCOPE: ContextVar[Owner | None] = ContextVar("tensorscope_current_scope", default=None)
