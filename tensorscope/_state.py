"""Ownership records: what tensorscope knows about each ref, and the owner contract.

# NOTE [ref state lives beside the tensor, not in it]
# Every TensorRef has one ``RefState``: a weak reference to the tensor (so scopes never keep a
# temporary alive) carrying its owner, creation site and disposal record in slots. It is found by
# ``id(tensor)`` in ``STATES`` rather than stored in the tensor's ``__dict__``: that would cost a
# dict per tensor on the hot path, and ``copy.deepcopy``/``torch.save`` copy ``__dict__``. The
# weak reference's callback runs when the tensor's C++ object dies (torch keeps a tensor's Python
# object alive while C++ still holds the tensor), which is when a ref "freed by Python" counts as
# disposed (docs/api.md §3).
#
# NOTE [the owner contract]
# An ``Owner`` (a ``DisposeScope``) keeps its refs in ``_owned``; only the methods below change
# it: ``adopt`` takes a state, ``release`` lets one go, ``resolve`` finds the nearest open owner
# outward (a closed scope keeps its link to its outer one). No other module touches ``_owned``.

Layer 4: imports only layers 0-3.
"""

from __future__ import annotations

import weakref

import torch

from tensorscope._sites import Site, format_site
from tensorscope.errors import DisposedTensorError, ScopeError

__all__ = [
    "CONVERTED",
    "STATES",
    "Counters",
    "Disposal",
    "Owner",
    "RefState",
    "disposed_error",
    "disposed_error_for",
    "move_state",
    "on_ref_death",
    "register_ref",
    "state_of",
]


class Counters:
    """Mutable per-thread statistics (docs/api.md §3); ``ts.stats()`` snapshots them."""

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

    __slots__ = ("dtype", "reason", "scope_name", "shape")

    def __init__(
        self, shape: tuple[int, ...], dtype: torch.dtype, scope_name: str | None, reason: str
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.scope_name = scope_name
        self.reason = reason


class Owner:
    """The owner contract (see the NOTE above); ``DisposeScope`` implements it."""

    name: str | None

    def __init__(self) -> None:
        self._owned: dict[int, RefState] = {}
        self._outer: Owner | None = None
        self._closed = False

    def adopt(self, state: RefState) -> None:
        """Own ``state`` (its previous owner must have released it)."""
        state.owner = self
        self._owned[state.key] = state

    def release(self, state: RefState) -> None:
        """Stop owning ``state`` (no-op if another owner has it)."""
        if self._owned.get(state.key) is state:
            del self._owned[state.key]
        if state.owner is self:
            state.owner = None

    def resolve(self) -> Owner | None:
        """This owner if open, else the nearest open owner outward."""
        owner: Owner | None = self
        while owner is not None and owner._closed:
            owner = owner._outer
        return owner

    def check_open(self) -> None:
        """Raise ``ScopeError`` if closed."""
        if self._closed:
            raise ScopeError(
                f"tensorscope.scope: {self.words()} is closed; only close(), is_closed, name "
                "and `in` work on a closed scope."
            )

    def owned_states(self) -> list[RefState]:
        """A snapshot of the states owned now."""
        return list(self._owned.values())

    def words(self) -> str:
        """How messages name this owner."""
        return f"scope {self.name!r}" if self.name else "an unnamed scope"


class RefState(weakref.ref):  # type: ignore[type-arg]
    """Weak reference to a TensorRef plus everything tensorscope knows about it."""

    __slots__ = ("counters", "disposal", "key", "owner", "site")

    key: int
    owner: Owner | None
    site: Site
    counters: Counters
    disposal: Disposal | None


STATES: dict[int, RefState] = {}
# Refs turned into Parameters/Buffers leave tensorscope but their death is still counted:
# their states are kept alive here (by id: a dead weak reference cannot be hashed).
CONVERTED: dict[int, RefState] = {}


def on_ref_death(
    state: RefState,
    _states: dict[int, RefState] = STATES,
    _converted: dict[int, RefState] = CONVERTED,
) -> None:
    # Default arguments bind the globals: this also runs during interpreter shutdown.
    key = state.key
    if _states.get(key) is state:
        del _states[key]
    if _converted:
        _converted.pop(id(state), None)
    if state.disposal is None:
        owner = state.owner
        if owner is not None:
            owned = owner._owned  # (the owner contract's release(), inlined: a hot path)
            if owned.get(key) is state:
                del owned[key]
            state.counters.disposed_in_scope += 1
        else:
            state.counters.disposed_outside_scope += 1


def register_ref(
    tensor: torch.Tensor, owner: Owner | None, site: Site, counters: Counters
) -> RefState:
    """The one constructor of ref states: register ``tensor`` (already of class TensorRef),
    owned by ``owner``, and count its creation."""
    state = RefState(tensor, on_ref_death)
    key = id(tensor)
    state.key = key
    state.owner = None
    state.site = site
    state.counters = counters
    state.disposal = None
    STATES[key] = state
    if owner is not None:
        owner.adopt(state)
        counters.created_in_scope += 1
    else:
        counters.created_outside_scope += 1
    return state


def move_state(state: RefState, new_owner: Owner | None) -> None:
    """Move ``state`` from its owner to ``new_owner``; statistics are the caller's business."""
    old = state.owner
    if old is new_owner:
        return
    if old is not None:
        old.release(state)
    if new_owner is not None:
        new_owner.adopt(state)


def state_of(tensor: object) -> RefState | None:
    """The state of a TensorRef (live or disposed), ``None`` for anything else."""
    state = STATES.get(id(tensor))
    if state is not None and state() is tensor:
        return state
    return None


def disposed_error(tensor: object) -> DisposedTensorError:
    """The error for using ``tensor``: what it was, where it came from, who disposed it."""
    state = state_of(tensor)
    if state is None or state.disposal is None:
        return DisposedTensorError("tensorscope.scope: this tensor was disposed")
    return disposed_error_for(state.disposal, state.site)


def disposed_error_for(disposal: Disposal, site: Site, context: str = "") -> DisposedTensorError:
    dtype = str(disposal.dtype).removeprefix("torch.")
    return DisposedTensorError(
        f"tensorscope.scope: {context}tensor of shape {disposal.shape} and dtype {dtype}, "
        f"created at {format_site(site)}, was disposed {disposal.reason} and can no longer be "
        "used. To keep a tensor beyond its scope, call t.move_to_outer() or "
        "t.detach_from_scope() (or s.exclude(t)) before the scope closes, or take a copy with "
        "t.clone() and detach_from_scope() it."
    )
