"""TensorRef, the torch.Tensor subclass users hold, and how a ref is disposed.

# NOTE [class switch, not wrapper]
# A ref is an ordinary tensor whose Python class was switched to ``TensorRef`` (a ``__class__``
# assignment, ~0.03 µs): same TensorImpl, same storage, same autograd identity. ``TensorRef``
# disables ``__torch_function__``, so ops on refs run at plain-tensor speed and return plain
# tensors outside scopes. A wrapper subclass would cost ~9-18 µs per op (DESIGN.md).
#
# NOTE [how disposal frees memory safely: the handle lets go, as in TorchSharp]
# A ref is a handle on a TensorImpl, and so are autograd's saved tensors, a view's base, a
# Parameter made from its data: C++ holds TensorImpls by refcount. Disposing a ref (1) records
# its shape/dtype/owner for the error message, (2) switches its class to ``DisposedTensor``,
# whose every Python path raises ``DisposedTensorError``, and (3) makes the user's Python object
# let go of its TensorImpl: a stand-in impl with no storage and the Python dispatch key takes its
# place (``torch._C._swap_tensor_impl``), so C++ paths that reach the handle (``torch.tensor(t)``,
# ``as_subclass``) raise through ``DisposedTensor.__torch_dispatch__`` too. The original impl —
# data, ``grad_fn``, version counter — is then freed by refcount at once, unless something else
# in C++ holds it: the graph of a tensor moved out of the scope (docs/api.md §8: a moved tensor
# keeps what its graph saved, until backward frees the graph or the tensor dies), a live view's
# base. A stray reference to a disposed output therefore pins neither its data nor its graph.
# Nothing is changed in place, so no live alias ever sees its data, graph or version change.
# ``storage.resize_(0)`` would free the bytes of every alias at once (Parameters, views that must
# stay valid) and leave tensors whose reads segfault; emptying the impl in place (the earlier
# design) broke every graph that saved it. Where torch refuses the swap (a C++ weak reference to
# the impl), autocast's weight cache, which holds one for a leaf that requires grad, is cleared
# and the swap retried; where it still refuses, the impl is emptied in place after all, its
# graph detached and its version counter poisoned so a backward that saved it raises
# (``_empty_in_place``).
# Step 3 runs on the thread that owns the scope (see _thread.py's NOTE on cross-thread close).

Layer 7: imports only layers 0-6.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self

from tensorscope._engine import FAST
from tensorscope._plain import PlainTensorProtocols
from tensorscope._sites import NotOwned, Site, capture_site, user_site
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
from tensorscope._thread import (
    CURRENT_SCOPE,
    ThreadState,
    mode_popped,
    owning_scope,
    thread_state,
)
from tensorscope._torch import (
    no_dispatch,
    no_subclass_function,
    poison_versions,
    storage_address,
    tracing,
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
    "stock_stand_ins",
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
        """Autograd's ``detach()``: the detached alias of a ref is a ref, owned by the current
        scope (unowned outside scopes).

        ``detach`` falls through the scope engines' key (torch's C functions need its result
        without a Python object, tensorscope/_adopt.py), so a ref's alias is made one here;
        ``nn.Parameter(ref)`` also needs ``detach()`` to keep the type of its argument.
        """
        out = torch.Tensor.detach(self)
        if type(out) is torch.Tensor:
            out.__class__ = TensorRef
            state = thread_state()
            site = capture_site(1)
            if isinstance(site, NotOwned) or tracing():
                register_ref(out, None, user_site(1), state.counters)
            else:
                register_ref(out, owning_scope(state), site, state.counters)
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
    records: list[tuple[Disposal, Site]] = []
    keys: list[int] = []
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
            _shape_of(tensor), tensor.dtype, owner.name if owner is not None else None, reason
        )
        state.disposal = disposal
        _unlink_grad(tensor)
        if tensor.layout is torch.strided and not tensor.is_nested and tensor.device.type != "meta":
            keys.append(storage_address(tensor))
        tensor.__class__ = DisposedTensor
        batch.append(tensor)
        records.append((disposal, state.site))
    if not batch:
        return
    elsewhere = isinstance(owner_thread, ThreadState) and not owner_thread.on_this_thread
    if elsewhere and owner_thread.alive:
        owner_thread.defer(batch)
        return
    _release_all(batch, records)
    hooks = residency_hooks()
    if hooks is not None and keys:
        hooks.storages_disposed(keys)


def _shape_of(tensor: torch.Tensor) -> tuple[int, ...]:
    with no_subclass_function():
        if tensor.is_nested:  # a nested tensor has no single shape: its components' count
            return (tensor.size(0),)
        return tuple(tensor.shape)


def release_pending(state: ThreadState) -> None:
    """Release what a close on another thread left to this thread (call on its thread)."""
    pending = state.take_pending()
    if pending:
        _release_all(pending)
        hooks = residency_hooks()
        if hooks is not None:
            hooks.storages_disposed([])


def _release_all(
    tensors: list[torch.Tensor], records: list[tuple[Disposal, Site]] | None = None
) -> None:
    failures: list[BaseException] = []
    refused: list[int] = []
    for index, tensor in enumerate(tensors):
        try:
            if not _let_go(tensor):
                refused.append(index)
        except Exception as exc:  # one odd tensor must not keep the others' memory
            failures.append(exc)
    if refused:
        _empty_in_place([tensors[i] for i in refused], records and [records[i] for i in refused])
    if failures:
        raise ScopeError(
            f"tensorscope.scope: the memory of {len(failures)} disposed tensor(s) could not be "
            f"released (they are disposed all the same): {failures[0]}"
        ) from failures[0]


def _unlink_grad(tensor: torch.Tensor) -> None:
    # A disposed leaf lets go of its .grad (never owned: autograd made it), which dies with it
    # unless the user holds it.
    with no_subclass_function():
        if tensor.is_leaf and tensor.requires_grad and tensor.grad is not None:
            tensor.grad = None


_swap_impl: Any = torch._C._swap_tensor_impl
_make_wrapper: Any = torch.Tensor._make_wrapper_subclass
_CPU = torch.device("cpu")

# NOTE [stand-ins are made ahead, at scope entry]
# A disposed handle keeps its stand-in TensorImpl as long as the user keeps the handle. Made at
# disposal, right after a step's large allocations, those small objects sat on top of glibc's
# heap and pinned the step's freed memory under them: an evaluation loop that kept every
# batch's (disposed) logits grew by one activation per batch (4 MiB a batch in the demo, where
# the earlier design stayed flat). So stand-ins come from a stock made when a scope opens,
# before the step allocates; a close that runs out makes more on the spot.
_STAND_INS: list[torch.Tensor] = []
_STOCK_LOW, _STOCK_HIGH = 64, 256


def _new_stand_in() -> torch.Tensor:
    with no_subclass_function():
        stand_in: torch.Tensor = _make_wrapper(DisposedTensor, (0,), device=_CPU)
    stand_in.__class__ = torch.Tensor  # what keeps a disposed impl alive is a plain alias
    return stand_in


def stock_stand_ins() -> None:
    """Refill the stand-in stock when it runs low (see the NOTE above)."""
    if len(_STAND_INS) < _STOCK_LOW:
        _STAND_INS.extend(_new_stand_in() for _ in range(_STOCK_HIGH - len(_STAND_INS)))


def _let_go(tensor: torch.Tensor) -> bool:
    """The handle lets go of its TensorImpl (see the NOTE above); False where torch refuses.

    A stand-in TensorImpl with no storage and the Python dispatch key takes the impl's place
    under the user's Python object (``torch._C._swap_tensor_impl``, what
    ``torch.utils.swap_tensors`` uses), so every path to the handle — Python or C++ — reaches
    ``DisposedTensor`` and raises. The original impl, with its data, graph and version
    counter, is left to whatever else in C++ holds it: autograd's saved tensors of a graph that
    was moved out of the scope, a live view's base. With no other holder it is freed at once.
    """
    stand_in = _STAND_INS.pop() if _STAND_INS else _new_stand_in()
    try:
        _swap_impl(tensor, stand_in)
    except RuntimeError:  # a C++ weak reference to the impl: autocast's weight cache?
        torch.clear_autocast_cache()  # an optimisation only: casts are redone when needed
        try:
            _swap_impl(tensor, stand_in)
        except RuntimeError:
            _STAND_INS.append(stand_in)  # unused
            return False
    return True


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


def _empty_in_place(
    tensors: list[torch.Tensor], records: list[tuple[Disposal, Site]] | None
) -> None:
    """Where the impl cannot be swapped: empty it in place (its graph detached), after
    poisoning its autograd version counter so a backward that saved it raises
    ``DisposedTensorError`` instead of reading the emptied data (``_torch.poison_versions``)."""
    poisoned: list[torch.Tensor] = []
    versions: list[int] = []
    kept: list[tuple[Disposal, Site] | None] = []
    with no_subclass_function():
        for index, tensor in enumerate(tensors):
            if not tensor._is_view() and not tensor.is_inference():
                poisoned.append(tensor)
                versions.append(_POISON_BASE + _next_poison[0] % _POISON_SPAN)
                kept.append(records[index] if records else None)
                _next_poison[0] += 1
        done = poison_versions(poisoned, versions) if poisoned else []
    for version, record, ok in zip(versions, kept, done, strict=True):
        if ok and record is not None:
            _recent[version] = record
    while len(_recent) > _RECENT_LIMIT:
        _recent.popitem(last=False)
    for tensor in tensors:
        with no_dispatch(), no_subclass_function():
            if not tensor._is_view() and tensor.grad_fn is not None:
                tensor.detach_()  # its graph, and the activations saved in it, are released
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
