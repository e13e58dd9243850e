"""TensorRef, the torch.Tensor subclass users hold, and how a ref is disposed.

# NOTE [class switch, not wrapper]
# A ref is an ordinary tensor whose Python class was switched to ``TensorRef`` (a ``__class__``
# assignment, ~0.03 µs): same TensorImpl, same storage, same autograd identity. ``TensorRef``
# disables ``__torch_function__``, so ops on refs run at plain-tensor speed and return plain
# tensors outside scopes. A wrapper subclass would cost ~9-18 µs per op (DESIGN.md).
#
# NOTE [how disposal frees memory safely]
# Disposing a ref (1) records its shape/dtype/owner for the error message, (2) switches its class
# to ``DisposedTensor``, whose every Python path raises ``DisposedTensorError``, (3) sets its
# autograd version counter to a poison value, so a backward that needs it (autograd saved it, or
# a shallow copy of it) fails the saved-tensor version check instead of reading released data,
# and (4) points its TensorImpl at a shared empty storage (``tensor.data = empty``), detached in
# place first so a disposed output kept in a stray list releases its autograd graph. Step 4 drops
# this tensor's hold on the storage, which PyTorch frees by refcount as soon as nothing else holds
# it, and leaves a valid 0-element tensor: C++ code that still reaches it gets a shape error,
# never a dangling pointer. ``storage.resize_(0)`` would free the bytes of every alias at once,
# including Parameters and views that must stay valid, and leaves tensors whose reads segfault.
# The counter is shared by a tensor, its views, its ``detach()`` aliases and autograd's saved
# copies, so a live alias must never see it change: views are not poisoned, and a tensor whose
# storage is also held by a tensor disposed later (a view moved out of the scope, the ``h`` of a
# ``d = h.detach()`` disposed in a nested scope) gets a poisoned counter of its own instead
# (C++ engine) or none (Python engine) (``_torch.poison_versions``).
# Step 4 runs on the thread that owns the scope (see _thread.py's NOTE on cross-thread close).

Layer 3: imports only layers 0-2.
"""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self

from tensorscope._engine import FAST
from tensorscope._plain import PlainTensorProtocols
from tensorscope._sites import Site, user_site
from tensorscope._slot import active_residency, residency_hooks
from tensorscope._state import (
    CONVERTED,
    Disposal,
    Owner,
    RefState,
    disposed_error,
    disposed_error_for,
    move_state,
    register_ref,
    state_of,
)
from tensorscope._thread import CURRENT_SCOPE, ThreadState, mode_popped, thread_state
from tensorscope._torch import (
    no_dispatch,
    no_subclass_function,
    poison_versions,
    storage_address,
)
from tensorscope.errors import ArgumentTypeError, DisposedTensorError, ResidencyError, ScopeError

if TYPE_CHECKING:
    from tensorscope.scope import DisposeScope

__all__ = [
    "DisposedTensor",
    "ResidencyMethods",
    "TensorRef",
    "dispose",
    "dispose_states",
    "ref",
    "release_pending",
]


class ResidencyMethods:
    """``tier``, ``promote()`` and ``demote()``: residency for refs and managed parameters."""

    __slots__ = ()

    def _check_live(self) -> None:
        return None

    @property
    def tier(self) -> str:
        """Where this tensor's data is now: "device", "host" or "disk" (docs/api.md §4)."""
        self._check_live()
        return str(_residency().tier_of(self))

    def promote(self) -> Self:
        """Bring the data to the device tier, making room under the budget."""
        self._check_live()
        _residency().promote(self)
        return self

    def demote(self, tier: str | None = None) -> Self:
        """Move the data down to ``tier`` ("host" or "disk"; default: the next tier down).

        Identity, views, autograd's saved tensors and an optimizer's reference are unchanged.
        """
        self._check_live()
        _residency().demote(self, tier)
        return self


class TensorRef(PlainTensorProtocols, ResidencyMethods, torch.Tensor):  # type: ignore[misc]
    """A tensor tensorscope tracks: owned by a dispose scope, disposable, movable between tiers.

    ``isinstance(t, torch.Tensor)`` holds and every torch function accepts it. Inside
    ``with ts.scope():`` every tensor a torch call returns is a ``TensorRef`` owned by that scope;
    ``ts.ref(t)`` turns a plain tensor into one explicitly.

    Example:
        >>> import torch, tensorscope as ts
        >>> with ts.scope() as s:
        ...     x = torch.ones(3)
        ...     kept = (x * 2).detach_from_scope()
        >>> x.is_disposed, kept.is_disposed, kept.tolist()
        (True, False, [2.0, 2.0, 2.0])
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # ----------------------------------------------------------------------------- ownership
    @property
    def scope(self) -> DisposeScope | None:
        """The owning :class:`~tensorscope.DisposeScope`, or ``None`` (unowned or disposed)."""
        state = state_of(self)
        if state is None or state.disposal is not None:
            return None
        return state.owner  # type: ignore[return-value]

    @property
    def is_disposed(self) -> bool:
        """Whether this ref was disposed (its data released; any use raises)."""
        return type(self) is DisposedTensor

    def _check_live(self) -> None:
        if type(self) is DisposedTensor:
            raise disposed_error(self)

    def dispose(self) -> None:
        """Release this ref's data now. Idempotent. Views of it keep the shared storage alive."""
        state = state_of(self)
        if state is not None and state.disposal is None:
            dispose_states([state], reason="by t.dispose()")

    def move_to_outer(self) -> Self:
        """Move to the outer scope of the owning scope (unowned if none); no-op if unowned."""
        state = _live_state(self)
        owner = state.owner
        if owner is not None:
            outer = owner._outer.resolve() if owner._outer is not None else None
            move_state(state, outer)
            if outer is None:
                state.counters.detached += 1
        return self

    def detach_from_scope(self) -> Self:
        """Leave the owning scope: the ref lives until Python drops it or it is disposed.

        (``detach()`` stays autograd's detach.)
        """
        state = _live_state(self)
        if state.owner is not None:
            move_state(state, None)
            state.counters.detached += 1
        return self

    def move_to_scope(self, scope: DisposeScope | None) -> Self:
        """Move to ``scope`` (attaching an unowned ref), or detach from any scope with ``None``.

        Moving between two scopes counts nothing; attaching an unowned ref counts ``attached``.

        Raises:
            ArgumentTypeError: ``scope`` is neither a ``DisposeScope`` nor ``None``.
            ScopeError: ``scope`` is closed.
        """
        if scope is None:
            return self.detach_from_scope()
        if not isinstance(scope, Owner):
            raise ArgumentTypeError(
                "tensorscope.scope: move_to_scope() takes a DisposeScope or None; got "
                f"{type(scope).__name__}."
            )
        state = _live_state(self)
        scope.check_open()
        if state.owner is not scope:
            if state.owner is None:
                state.counters.attached += 1
            move_state(state, scope)
        return self

    @property
    def target(self) -> torch.Tensor:
        """A plain ``torch.Tensor`` viewing this ref's data (autograd flows through it).

        It holds the data on its own: it stays valid even if the ref is disposed later.
        """
        self._check_live()
        with no_dispatch(), no_subclass_function():
            return torch.Tensor.view_as(self, self)

    # ------------------------------------------------------------------------------ autograd
    def backward(
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """Autograd's ``backward()``, run without the interceptor (what the engine creates is
        its own: gradient temporaries and ``.grad``s). A backward that needs a disposed tensor
        raises ``DisposedTensorError``."""
        plain_backward: Any = torch.Tensor.backward
        self._check_live()
        try:  # managed operands need the mode: the residency manager keeps it
            with mode_popped("backward", keep_mode=active_residency() is not None):
                plain_backward(self, gradient, retain_graph, create_graph, inputs)
        except RuntimeError as exc:
            error = disposed_error_from_autograd(exc)
            if error is None:
                raise
            raise error from exc

    def __coerce_same_metadata_as_tangent__(
        self, expected_metadata: Any, expected_type: type | None = None
    ) -> torch.Tensor | None:
        """A compiled backward (AOTAutograd) checks the exact type of the gradient it is given:
        a ref (say ``torch.ones_like(loss)`` made in a scope, passed to ``backward()``) is
        handed over as a plain alias of the same data."""
        if expected_metadata is not None or expected_type not in (None, torch.Tensor):
            return None
        self._check_live()
        with no_dispatch(), no_subclass_function():
            return torch.Tensor.view_as(self, self)

    def detach(self) -> torch.Tensor:
        """Autograd's ``detach()``; outside any scope, the detached alias of a ref is a ref too.

        (Inside a scope every result is a ref of the scope anyway.) ``nn.Parameter(ref)`` needs
        ``detach()`` to keep the type of its argument; the ref is unowned.
        """
        out = torch.Tensor.detach(self)
        if type(out) is torch.Tensor:
            out.__class__ = TensorRef
            register_ref(out, None, _site(), thread_state().counters)
        return out

    # ----------------------------------------- nn.Parameter / nn.Buffer made from a ref
    # Inside a scope, ``nn.Parameter(data)`` receives a ref and takes its subclass path:
    # ``t = data.detach(); t._is_param = True``. Intercepting that assignment turns ``t`` into a
    # real, unowned ``nn.Parameter`` (parameters are never owned by scopes); same for Buffer.
    @property
    def _is_param(self) -> bool:
        return False

    @_is_param.setter
    def _is_param(self, value: bool) -> None:
        if value:
            _convert(self, torch.nn.Parameter)

    @property
    def _is_buffer(self) -> bool:
        return False

    @_is_buffer.setter
    def _is_buffer(self, value: bool) -> None:
        if value:
            _convert(self, torch.Tensor)
            self.__dict__["_is_buffer"] = True


class DisposedTensor(TensorRef):
    """The class of a disposed ref: every torch function or method on it raises.

    ``is_disposed`` and ``dispose()`` still work (they are not torch functions).
    """

    @classmethod
    def __torch_function__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.Tensor.__hash__:  # identity hash: sets/dicts of refs keep working
            with no_subclass_function():
                return func(*args, **(kwargs or {}))  # type: ignore[no-untyped-call]
        raise _disposed_among(args, kwargs, func)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Ops that reach a released, disposed tensor from C++ (``torch.tensor(t)``,
        ``t.as_subclass(...)``) raise too: the C++ engine gives it the Python dispatch key."""
        raise _disposed_among(args, kwargs, func)


def _disposed_among(
    args: Iterable[Any], kwargs: dict[str, Any] | None, func: Any
) -> DisposedTensorError:
    """The error naming the first disposed tensor among ``func``'s arguments."""
    for candidate in _iter_tensors(args, kwargs):
        if type(candidate) is DisposedTensor:
            return disposed_error(candidate)
    return DisposedTensorError(f"tensorscope.scope: {func} was given a disposed tensor")


def _iter_tensors(args: Iterable[Any], kwargs: dict[str, Any] | None) -> Iterable[Any]:
    for arg in args:
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg
    if kwargs:
        yield from kwargs.values()


def _residency() -> Any:
    hooks = residency_hooks()
    if hooks is None:
        raise ResidencyError(
            "tensorscope.residency: the residency manager is not loaded; import tensorscope."
        )
    return hooks


def _site() -> Site:
    return user_site(2)


def _live_state(tensor: TensorRef) -> RefState:
    state = state_of(tensor)
    if state is None:
        raise ScopeError("tensorscope.scope: this TensorRef is not registered (internal error)")
    if state.disposal is not None:
        raise disposed_error(tensor)
    return state


# ------------------------------------------------------------------------------------ disposal
# Version counters of disposed tensors start here (autograd counters are 32-bit; real tensors
# stay far below). The recent disposals are remembered by version for backward's error message.
_POISON_BASE = 1 << 30
_POISON_SPAN = 1 << 29
_RECENT_LIMIT = 4096
_recent: OrderedDict[int, tuple[Disposal, Site]] = OrderedDict()
_next_poison = [0]
_VERSION_ERROR = re.compile(r"is at version (\d+); expected version")


def disposed_error_from_autograd(exc: BaseException) -> DisposedTensorError | None:
    """The DisposedTensorError behind autograd's saved-tensor version error, if it is one."""
    if "saved tensor that has been detached in-place" in str(exc):
        # An input autograd saved was disposed (disposal detaches in place to free its graph).
        return DisposedTensorError(
            "tensorscope.scope: backward needs a tensor that autograd saved and a scope "
            "disposed (its data was released). Run backward() inside the scope that made the "
            "graph, or keep the tensors it needs with move_to_outer() / detach_from_scope()."
        )
    match = _VERSION_ERROR.search(str(exc))
    if match is None or int(match.group(1)) < _POISON_BASE:
        return None
    record = _recent.get(int(match.group(1)))
    context = "backward needs a saved "
    if record is None:
        return DisposedTensorError(
            f"tensorscope.scope: {context}tensor that was disposed (its data was released). "
            "Run backward() inside the scope that made the graph, or keep the activations "
            "with move_to_outer() / detach_from_scope()."
        )
    return disposed_error_for(record[0], record[1], context=context)


def dispose_states(states: Iterable[RefState], reason: str, owner_thread: Any = None) -> None:
    """Dispose every live, undisposed ref in ``states`` as one batch (see the NOTE above).

    ``reason`` completes the error text "was disposed ...". When ``owner_thread`` (the
    ``ThreadState`` of the scope that owned them) is another live thread, releasing the memory
    is left to that thread (see _thread.py's NOTE on cross-thread close).
    """
    batch: list[torch.Tensor] = []
    keys: list[int] = []
    poisoned: list[torch.Tensor] = []
    versions: list[int] = []
    sites: list[tuple[Disposal, Site]] = []
    for state in states:
        tensor = state()
        if tensor is None or state.disposal is not None:
            continue
        owner = state.owner
        if owner is not None:
            owner.release(state)
            state.counters.disposed_in_scope += 1
        else:
            state.counters.disposed_outside_scope += 1
        disposal = Disposal(
            tuple(tensor.shape), tensor.dtype, owner.name if owner is not None else None, reason
        )
        state.disposal = disposal
        _unlink_grads(tensor, state)
        if tensor.layout is torch.strided and tensor.device.type != "meta":
            keys.append(storage_address(tensor))
        if not tensor._is_view() and not tensor.is_inference():
            poisoned.append(tensor)
            versions.append(_POISON_BASE + _next_poison[0] % _POISON_SPAN)
            sites.append((disposal, state.site))
            _next_poison[0] += 1
        tensor.__class__ = DisposedTensor
        batch.append(tensor)
    if poisoned:
        with no_subclass_function():
            done = poison_versions(poisoned, versions)
        for version, record, ok in zip(versions, sites, done, strict=True):
            if ok:
                _recent[version] = record
        while len(_recent) > _RECENT_LIMIT:
            _recent.popitem(last=False)
    if not batch:
        return
    elsewhere = isinstance(owner_thread, ThreadState) and not owner_thread.on_this_thread
    if elsewhere and owner_thread.alive:
        owner_thread.defer(batch)
        return
    _release_all(batch)
    hooks = residency_hooks()
    if hooks is not None and keys:
        hooks.storages_disposed(keys)


def release_pending(state: ThreadState) -> None:
    """Release what a close on another thread left to this thread (call on its thread)."""
    pending = state.take_pending()
    if pending:
        _release_all(pending)
        hooks = residency_hooks()
        if hooks is not None:
            hooks.storages_disposed([])


def _release_all(tensors: list[torch.Tensor]) -> None:
    failures: list[BaseException] = []
    for tensor in tensors:
        try:
            _release(tensor)
        except Exception as exc:  # one odd tensor must not keep the others' memory
            failures.append(exc)
    if failures:
        raise ScopeError(
            f"tensorscope.scope: the memory of {len(failures)} disposed tensor(s) could not be "
            f"released (they are disposed all the same): {failures[0]}"
        ) from failures[0]


def _unlink_grads(tensor: torch.Tensor, state: RefState) -> None:
    # Autograd writes into a leaf's .grad from C++; cut the link so a later backward makes a
    # fresh gradient instead of accumulating into a disposed one.
    with no_subclass_function():
        if state.grad_of is not None:
            leaf = state.grad_of()
            if leaf is not None and type(leaf) is not DisposedTensor and leaf.grad is tensor:
                leaf.grad = None
        if tensor.is_leaf and tensor.requires_grad and tensor.grad is not None:
            tensor.grad = None


_EMPTIES: dict[tuple[torch.dtype, torch.device, torch.layout], torch.Tensor] = {}


def _empty_like(tensor: torch.Tensor) -> torch.Tensor:
    key = (tensor.dtype, tensor.device, tensor.layout)
    empty = _EMPTIES.get(key)
    if empty is None:
        layout = tensor.layout
        if layout is torch.strided:
            empty = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        elif layout is torch.sparse_coo:
            empty = torch.sparse_coo_tensor(
                torch.empty((1, 0), dtype=torch.int64),
                torch.empty(0, dtype=tensor.dtype),
                (0,),
                check_invariants=False,
            ).to(tensor.device)
        else:  # compressed sparse layouts
            empty = torch.empty((0, 0), dtype=tensor.dtype, layout=layout, device=tensor.device)
        _EMPTIES[key] = empty
    return empty


def _release(tensor: torch.Tensor) -> None:
    """Drop this TensorImpl's hold on its storage and, when possible, on its autograd graph."""
    with no_dispatch(), no_subclass_function():
        if not tensor._is_view() and tensor.grad_fn is not None:
            # A disposed output kept in a stray list would otherwise keep its whole graph
            # (and the activations saved in it) alive. Views cannot be detached in place.
            tensor.detach_()
        # Disposed tensors share one 0-byte tensor per dtype, device and layout: nothing can
        # grow it (every Python path raises; with the C++ engine so does every op that reaches
        # it from C++, elsewhere those fail on its shape).
        tensor.data = _empty_like(tensor)
        if FAST is not None:
            FAST.guard_disposed(tensor)


# ------------------------------------------------------------------------------ conversions
def unown_buffer(module: torch.nn.Module, name: str, buffer: torch.Tensor | None) -> None:
    """Global buffer-registration hook: a buffer made inside a scope is never owned by it."""
    if type(buffer) is TensorRef:
        _convert(buffer, torch.Tensor)


def unown(tensors: Iterable[object]) -> None:
    """Refs among ``tensors`` leave their scopes as plain tensors (torch keeps them as state)."""
    for tensor in tensors:
        if type(tensor) is TensorRef:
            _convert(tensor, torch.Tensor)


def _convert(tensor: TensorRef, cls: type[torch.Tensor]) -> None:
    """Turn a ref into a plain ``cls`` that tensorscope no longer owns (counts as detached)."""
    state = state_of(tensor)
    if state is not None:
        if state.owner is not None:
            move_state(state, None)
            state.counters.detached += 1
        CONVERTED[id(state)] = state  # its death still counts as disposed (outside scope)
    tensor.__class__ = cls  # type: ignore[assignment]


def grad_owner_for(leaf: torch.Tensor) -> Owner | None:
    """The scope owning the ``.grad`` autograd is creating for ``leaf``.

    That is the leaf's own (open) scope when the leaf is an owned ref, else ``None``: gradients
    of parameters and of other tensors no scope owns are never owned (docs/api.md §2).
    """
    state = state_of(leaf)
    if state is None or state.disposal is not None or state.owner is None:
        return None
    return state.owner.resolve()


def mark_grad_of(state: RefState, leaf: torch.Tensor) -> None:
    state.grad_of = weakref.ref(leaf)


# ------------------------------------------------------------------------------ public helpers
def ref(tensor: torch.Tensor) -> TensorRef:
    """Make ``tensor`` a :class:`TensorRef`, owned by the current scope if one is open.

    A plain ``torch.Tensor`` is converted in place (the same object is returned); a ref is
    returned unchanged. Outside a scope the new ref is unowned (it counts as
    ``created_outside_scope``).

    Raises:
        ArgumentTypeError: ``tensor`` is not a tensor.
        ScopeError: ``tensor`` is an ``nn.Parameter`` or another tensor subclass (parameters
            are never owned by scopes).

    Example:
        >>> import torch, tensorscope as ts
        >>> t = torch.zeros(2)
        >>> ts.ref(t) is t, isinstance(t, ts.TensorRef)
        (True, True)
    """
    if isinstance(tensor, TensorRef):
        return tensor
    check_convertible(tensor, "ts.ref()")
    current = CURRENT_SCOPE.get()
    owner = current.resolve() if current is not None else None
    tensor.__class__ = TensorRef
    register_ref(tensor, owner, _site(), thread_state().counters)
    return tensor  # type: ignore[return-value]


def check_convertible(tensor: object, what: str) -> None:
    """Refuse what cannot become a ref: non-tensors and tensor subclasses (parameters)."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(
            f"tensorscope.scope: {what} takes tensors; got {type(tensor).__name__}."
        )
    if type(tensor) is not torch.Tensor:
        raise ScopeError(
            f"tensorscope.scope: {what} cannot take a {type(tensor).__name__}: parameters, "
            "buffers and other tensor subclasses are never owned by scopes. Pass a plain "
            "tensor (e.g. p.detach()) if you need a disposable copy of its data."
        )


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
            check_convertible(tensor, "ts.dispose()")
            ref(tensor)
        state = state_of(tensor)
        if state is not None:
            states.append(state)
    dispose_states(states, reason="by ts.dispose()")
