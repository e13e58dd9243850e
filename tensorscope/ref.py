"""TensorRef: the torch.Tensor subclass users hold, and how a ref is disposed.

# NOTE [class switch, not wrapper]
# A ref is an ordinary tensor whose Python class was switched to ``TensorRef`` (a ``__class__``
# assignment, ~0.1 µs): same TensorImpl, same storage, same autograd identity. ``TensorRef``
# disables ``__torch_function__``, so ops on refs run at plain-tensor speed and return plain
# tensors outside scopes. A wrapper subclass would cost ~9-18 µs per op (DESIGN.md).
#
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import Self

from tensorscope._sites import capture_site, format_site
from tensorscope._state import (
    CONVERTED,
    CURRENT_SCOPE,
    Disposal,
    RefState,
    new_state,
    state_of,
    thread_data,
)
from tensorscope.errors import ArgumentTypeError, DisposedTensorError, ScopeError

if TYPE_CHECKING:
    from tensorscope.scope import DisposeScope
    from tensorscope.scope import DisposeScope as Owner

__all__ = [
    "DisposedTensor",
    "TensorRef",
    "disposed_error",
    "ref",
    "resolve_open",
    "set_owner",
]

_no_dispatch = torch._C._DisableTorchDispatch
_no_subclass_function = torch._C.DisableTorchFunctionSubclass


def plain_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` sharing ``tensor``'s storage, made without our interceptor."""
    with _no_dispatch(), _no_subclass_function():
        return torch.Tensor.detach(tensor)


def resolve_open(owner: Owner | None) -> Owner | None:
    """``owner`` if open, else the nearest open scope outward (closed scopes keep their link)."""
    while owner is not None and owner._closed:
        owner = owner._outer
    return owner


def set_owner(state: RefState, new_owner: Owner | None) -> None:
    """Move ``state`` from its owner to ``new_owner``; statistics are the caller's business."""
    old = state.owner
    if old is new_owner:
        return
    key = state.key
    if old is not None and old._owned.get(key) is state:
        del old._owned[key]
    state.owner = new_owner
    if new_owner is not None:
        new_owner._owned[key] = state


class ResidencyMethods:
    """``tier``, ``promote()`` and ``demote()``: residency for refs and managed parameters."""

    __slots__ = ()

    @property
    def tier(self) -> str:
        """Where this tensor's data is now: "device", "host" or "disk" (API.md §4)."""
        from tensorscope.residency import residency

        _check_live(self)  # type: ignore[arg-type]
        return residency.tier_of(self)  # type: ignore[arg-type]

    def promote(self) -> Self:
        """Bring the data to the device tier, making room under the budget."""
        from tensorscope.residency import residency

        _check_live(self)  # type: ignore[arg-type]
        residency.promote(self)  # type: ignore[arg-type]
        return self

    def demote(self, tier: str | None = None) -> Self:
        """Move the data down to ``tier`` ("host" or "disk"; default: the next tier down).

        Identity, views, autograd's saved tensors and an optimizer's reference are unchanged.
        """
        from tensorscope.residency import residency

        _check_live(self)  # type: ignore[arg-type]
        residency.demote(self, tier)  # type: ignore[arg-type]
        return self


class TensorRef(ResidencyMethods, torch.Tensor):
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
        return state.owner

    @property
    def is_disposed(self) -> bool:
        """Whether this ref was disposed (its data released; any use raises)."""
        return type(self) is DisposedTensor

    def dispose(self) -> None:
        """Release this ref's data now. Idempotent. Views of it keep the shared storage alive."""
        from tensorscope._dispose import dispose_states  # late: _dispose builds on this module

        state = state_of(self)
        if state is not None and state.disposal is None:
            dispose_states([state], reason="by t.dispose()")

    def move_to_outer(self) -> Self:
        """Move to the outer scope of the owning scope (unowned if none); no-op if unowned."""
        state = _live_state(self)
        owner = state.owner
        if owner is not None:
            outer = resolve_open(owner._outer)
            set_owner(state, outer)
            if outer is None:
                state.counters.detached += 1
        return self

    def detach_from_scope(self) -> Self:
        """Leave the owning scope: the ref lives until Python drops it or it is disposed.

        (``detach()`` stays autograd's detach.)
        """
        state = _live_state(self)
        if state.owner is not None:
            set_owner(state, None)
            state.counters.detached += 1
        return self

    def move_to_scope(self, scope: DisposeScope | None) -> Self:
        """Move to ``scope`` (attaching an unowned ref), or detach from any scope with ``None``.

        Moving between two scopes counts nothing; attaching an unowned ref counts ``attached``.
        """
        if scope is None:
            return self.detach_from_scope()
        state = _live_state(self)
        scope._check_open()
        if state.owner is not scope:
            if state.owner is None:
                state.counters.attached += 1
            set_owner(state, scope)
        return self

    @property
    def target(self) -> torch.Tensor:
        """A plain ``torch.Tensor`` viewing this ref's data (autograd flows through it).

        It holds the data on its own: it stays valid even if the ref is disposed later.
        """
        _check_live(self)
        with _no_dispatch(), _no_subclass_function():
            return torch.Tensor.view_as(self, self)

    def backward(
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """Autograd's ``backward()``, run without the interceptor (see _intercept.py's NOTE on
        backward): what the engine creates is its own business, at plain-PyTorch speed."""
        from tensorscope._intercept import backward_unintercepted  # late: it builds on refs

        plain_backward: Any = torch.Tensor.backward
        with backward_unintercepted():
            plain_backward(self, gradient, retain_graph, create_graph, inputs)

    def detach(self) -> torch.Tensor:
        """Autograd's ``detach()``; outside any scope, the detached alias of a ref is a ref too.

        (Inside a scope every result is a ref of the scope anyway.) ``nn.Parameter(ref)`` needs
        ``detach()`` to keep the type of its argument; the ref is unowned.
        """
        out = torch.Tensor.detach(self)
        if type(out) is torch.Tensor:
            out.__class__ = TensorRef
            new_state(out, None, capture_site(), thread_data().counters)
        return out

    # ------------------------------------------------------------------ plain-tensor protocols
    # Printed and formatted exactly as a plain tensor with the same data and autograd state
    # (torch prints subclasses as "TensorRef(...)" and formats only plain 0-d tensors as numbers).
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        plain_repr: Any = torch.Tensor.__repr__
        with _as_plain(self):
            return str(plain_repr(self, tensor_contents=tensor_contents))

    def __format__(self, format_spec: str) -> str:
        plain_format: Any = torch.Tensor.__format__
        with _as_plain(self):
            return str(plain_format(self, format_spec))

    def __reduce_ex__(self, proto: Any) -> Any:
        # torch.save / pickle store plain data: a ref loads back as a plain tensor.
        _check_live(self)
        return torch.Tensor._reduce_ex_internal(self, proto)  # type: ignore[no-untyped-call]

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        _check_live(self)
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the "
                "deepcopy protocol at the moment (same rule as torch.Tensor)."
            )
        with torch.no_grad():
            new = self.clone()  # a ref of the current scope inside one, else plain
        if self.requires_grad:
            new.requires_grad_(True)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        memo[id(self)] = new
        return new

    def numpy(self, *, force: bool = False) -> Any:
        # The array keeps a plain alias made outside the interceptor, so its data stays valid
        # while the array lives even if this ref is disposed (numpy reads memory directly).
        _check_live(self)
        with _no_dispatch(), _no_subclass_function():
            return torch.Tensor.numpy(self, force=force)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        _check_live(self)
        with _no_dispatch(), _no_subclass_function():
            return torch.Tensor.__dlpack__(plain_alias(self), *args, **kwargs)

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
            with _no_subclass_function():
                return func(*args, **(kwargs or {}))  # type: ignore[no-untyped-call]
        for candidate in _iter_tensors(args, kwargs):
            if type(candidate) is DisposedTensor:
                raise disposed_error(candidate)
        raise DisposedTensorError("tensorscope.scope: a disposed tensor was used")


def _iter_tensors(args: Iterable[Any], kwargs: dict[str, Any] | None) -> Iterable[Any]:
    for arg in args:
        if isinstance(arg, (list, tuple)):
            yield from arg
        else:
            yield arg
    if kwargs:
        yield from kwargs.values()


def disposed_error(tensor: object) -> DisposedTensorError:
    """The error for using ``tensor``: what it was, where it came from, who disposed it."""
    state = state_of(tensor)
    if state is None or state.disposal is None:
        return DisposedTensorError("tensorscope.scope: this tensor was disposed")
    return disposed_error_for(state.disposal, format_site(state.site))


def disposed_error_for(disposal: Disposal, site: str) -> DisposedTensorError:
    dtype = str(disposal.dtype).removeprefix("torch.")
    return DisposedTensorError(
        f"tensorscope.scope: tensor of shape {disposal.shape} and dtype {dtype}, created at "
        f"{site}, was disposed {disposal.reason} and can no longer be used. To keep a tensor "
        "beyond its scope, call t.move_to_outer() or t.detach_from_scope() (or s.exclude(t)) "
        "before the scope closes, or take a copy with t.clone() and detach_from_scope() it."
    )


@contextlib.contextmanager
def _as_plain(tensor: TensorRef) -> Iterator[None]:
    _check_live(tensor)
    cls = tensor.__class__
    tensor.__class__ = torch.Tensor  # type: ignore[assignment]
    try:
        yield
    finally:
        tensor.__class__ = cls


def _check_live(tensor: TensorRef) -> None:
    if type(tensor) is DisposedTensor:
        raise disposed_error(tensor)


def _live_state(tensor: TensorRef) -> RefState:
    state = state_of(tensor)
    if state is None:
        raise ScopeError("tensorscope.scope: this TensorRef is not registered (internal error)")
    if state.disposal is not None:
        raise disposed_error(tensor)
    return state


def unown_buffer(module: torch.nn.Module, name: str, buffer: torch.Tensor | None) -> None:
    """Global buffer-registration hook: a buffer made inside a scope is never owned by it."""
    if type(buffer) is TensorRef:
        _convert(buffer, torch.Tensor)


def _convert(tensor: TensorRef, cls: type[torch.Tensor]) -> None:
    """Turn a ref into a plain ``cls`` that tensorscope no longer owns (counts as detached)."""
    state = state_of(tensor)
    if state is not None:
        if state.owner is not None:
            set_owner(state, None)
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
    _check_convertible(tensor, "ts.ref()")
    owner = resolve_open(CURRENT_SCOPE.get())
    tensor.__class__ = TensorRef
    new_state(tensor, owner, capture_site(), thread_data().counters)
    return tensor  # type: ignore[return-value]


def _check_convertible(tensor: object, what: str) -> None:
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


def grad_owner_for(leaf: torch.Tensor) -> Owner | None:
    """The scope owning the ``.grad`` autograd is creating for ``leaf``.

    That is the leaf's own (open) scope when the leaf is an owned ref, else ``None``: gradients
    of parameters and of other tensors no scope owns are never owned (API.md §2).
    """
    state = state_of(leaf)
    if state is None or state.disposal is not None or state.owner is None:
        return None
    return resolve_open(state.owner)


def mark_grad_of(state: RefState, leaf: torch.Tensor) -> None:
    state.grad_of = weakref.ref(leaf)
