"""Dispose scopes (TorchSharp's DisposeScope in Python idiom) and their statistics.

``with ts.scope():`` owns every tensor a torch call returns inside it and disposes, at exit,
those still alive: their memory is released now, not when Python gets around to it.
Scopes form a stack per thread and per asyncio task (a contextvar holds the innermost one).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, TypeVar, overload

import torch
from typing_extensions import ParamSpec, Self

from tensorscope import _intercept
from tensorscope._leaks import LeakRecord, find_leaks, warn_leaks
from tensorscope._reach import tensors_in
from tensorscope._sites import user_site
from tensorscope._state import Owner, disposed_error, move_state, register_ref, state_of
from tensorscope._thread import CURRENT_SCOPE, ThreadState, thread_state
from tensorscope.errors import ArgumentTypeError, ScopeError
from tensorscope.ref import DisposedTensor, TensorRef, check_convertible, dispose_states

__all__ = [
    "DisposeScope",
    "LeakRecord",
    "Stats",
    "current_scope",
    "dispose_everything",
    "dispose_everything_but",
    "reset_stats",
    "scope",
    "stats",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Stats:
    """A snapshot of this thread's ref counters (docs/api.md §3). ``live`` = created - disposed."""

    created_in_scope: int
    created_outside_scope: int
    disposed_in_scope: int
    disposed_outside_scope: int
    attached: int
    detached: int

    @property
    def live(self) -> int:
        created = self.created_in_scope + self.created_outside_scope
        return created - self.disposed_in_scope - self.disposed_outside_scope

    def __str__(self) -> str:
        return (
            f"live {self.live}: created {self.created_in_scope} in scope / "
            f"{self.created_outside_scope} outside, disposed {self.disposed_in_scope} in scope / "
            f"{self.disposed_outside_scope} outside, attached {self.attached}, "
            f"detached {self.detached}"
        )


def stats() -> Stats:
    """This thread's counters of refs created, disposed, attached and detached.

    Counts are kept by the thread that created each ref. Refs that Python frees count as
    disposed (in or outside a scope by their owner at that moment).

    Example:
        >>> import torch, tensorscope as ts
        >>> ts.reset_stats()
        >>> with ts.scope():
        ...     x = torch.ones(2) + 1
        >>> ts.stats().created_in_scope, ts.stats().live
        (2, 0)
    """
    c = thread_state().counters
    return Stats(
        c.created_in_scope,
        c.created_outside_scope,
        c.disposed_in_scope,
        c.disposed_outside_scope,
        c.attached,
        c.detached,
    )


def reset_stats() -> None:
    """Zero this thread's counters."""
    thread_state().counters.reset()


class DisposeScope(Owner):
    """A scope that owns the tensors created while it is the innermost open scope.

    Use it as a context manager (``with ts.scope(name="step") as s:``) or as a decorator
    (``@ts.scope()``: a new scope per call; refs of that scope found in the return value move
    to the caller's scope, so returning a tensor works). At exit every ref it still owns is
    disposed. See docs/api.md §1 for every member.

    Example:
        >>> import torch, tensorscope as ts
        >>> keep = []
        >>> with ts.scope(name="step") as s:
        ...     x = torch.randn(4, 4)
        ...     y = (x @ x).relu()
        ...     keep.append(s.move_to_outer(y.sum()))
        >>> x.is_disposed, len(s) if not s.is_closed else "closed"
        (True, 'closed')
    """

    def __init__(self, name: str | None = None, *, report_leaks: bool = False) -> None:
        if name is not None and not isinstance(name, str):
            raise ArgumentTypeError(
                f"tensorscope.scope: a scope name must be a str; got {type(name).__name__}"
            )
        super().__init__()
        self.name = name
        self.report_leaks = bool(report_leaks)
        self.leaks: list[LeakRecord] = []
        self._entered = False
        self._thread: ThreadState | None = None
        self._locals_at_entry: set[int] = set()

    # -------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> Self:
        if self._closed:
            raise ScopeError(
                f"tensorscope.scope: {self.words()} is closed and cannot be re-entered; "
                "create a new one with ts.scope()."
            )
        if self._entered:
            raise ScopeError(
                f"tensorscope.scope: {self.words()} is already open; a scope is entered once "
                "(use a new ts.scope() for each block, or @ts.scope() on a function)."
            )
        current = CURRENT_SCOPE.get()
        self._outer = current.resolve() if current is not None else None
        if self.report_leaks:
            frame = sys._getframe(1)
            self._locals_at_entry = {id(value) for value in frame.f_locals.values()}
            del frame
        self._entered = True
        self._thread = thread_state()
        CURRENT_SCOPE.set(self)
        _intercept.acquire(self._thread)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._closed:
            self._close(sys._getframe(1))
        elif self._thread is not None:  # closed from another thread: clean up on this one
            _intercept.settle(self._thread)
        # Returning None: an exception raised in the block propagates unchanged.

    def close(self) -> None:
        """Dispose everything owned and unlink the scope. Idempotent; any order is allowed."""
        if not self._closed:
            self._close(sys._getframe(1))

    def _close(self, frame: FrameType | None) -> None:
        self._closed = True
        try:
            if self.report_leaks and frame is not None:
                self.leaks = find_leaks(self, frame, self._locals_at_entry)
            dispose_states(
                self.owned_states(), reason=f"when {self.words()} closed", owner_thread=self._thread
            )
        finally:
            self._owned.clear()
            outer = self._outer.resolve() if self._outer is not None else None
            if CURRENT_SCOPE.get() is self:
                CURRENT_SCOPE.set(outer)
            if self._entered and self._thread is not None:
                _intercept.release(self._thread)
        if self.leaks:  # warned last: a warning turned into an error must not stop the close
            warn_leaks(self.words(), self.leaks)

    def __call__(self, func: Callable[_P, _R]) -> Callable[_P, _R]:
        """Decorator: run each call of ``func`` in a new scope like this one.

        On a generator function, the scope lives as long as the generator and is current only
        while its body runs (not while it is suspended at a ``yield``): what the consumer makes
        between two items is never the generator's. Refs it yields or returns move to the
        consumer's scope (unowned if there is none)."""
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise ArgumentTypeError(
                "tensorscope.scope: @ts.scope() cannot decorate a coroutine function (the scope "
                "would close before the coroutine runs); use `with ts.scope():` inside it."
            )
        name, report_leaks = self.name, self.report_leaks
        if inspect.isgeneratorfunction(func):
            return _scoped_generator(func, name, report_leaks)  # type: ignore[return-value]

        @functools.wraps(func)
        def scoped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with DisposeScope(name, report_leaks=report_leaks) as inner:
                result = func(*args, **kwargs)
                outer = inner._outer.resolve() if inner._outer is not None else None
                _hand_over(result, inner, outer)
                return result

        return scoped

    # ---------------------------------------------------------------------------- queries
    @property
    def is_closed(self) -> bool:
        """Whether the scope was closed (closed scopes cannot be used or re-entered)."""
        return self._closed

    @property
    def outer(self) -> DisposeScope | None:
        """The enclosing open scope (``None`` at the outermost level)."""
        self.check_open()
        return self._outer.resolve() if self._outer is not None else None  # type: ignore[return-value]

    def tracked(self) -> list[TensorRef]:
        """A snapshot list of the live refs this scope owns."""
        self.check_open()
        return [t for t in (s() for s in list(self._owned.values())) if t is not None]

    def __bool__(self) -> bool:
        """A scope is truthy, open or closed, empty or not (``len()`` counts its refs)."""
        return True

    def __len__(self) -> int:
        self.check_open()
        return len(self._owned)

    def __contains__(self, tensor: object) -> bool:
        state = state_of(tensor)
        return state is not None and state.owner is self and state.disposal is None

    def __repr__(self) -> str:
        status = "closed" if self._closed else f"{len(self._owned)} refs"
        return f"<DisposeScope {self.name!r} {status}>" if self.name else f"<DisposeScope {status}>"

    # ---------------------------------------------------------------------- ownership moves
    @overload
    def include(self, tensor: torch.Tensor, /) -> TensorRef: ...
    @overload
    def include(self, *tensors: torch.Tensor) -> tuple[TensorRef, ...]: ...
    def include(self, *tensors: torch.Tensor) -> TensorRef | tuple[TensorRef, ...]:
        """Take ownership (TorchSharp ``Attach``); plain tensors are made refs first.

        Unowned refs are adopted and refs owned by another scope move here (one ``attached``
        each); a plain ``torch.Tensor`` becomes a ref owned here and is returned.
        """
        self.check_open()
        refs: list[TensorRef] = []
        for tensor in tensors:
            if type(tensor) is DisposedTensor:
                raise disposed_error(tensor)
            state = state_of(tensor) if isinstance(tensor, TensorRef) else None
            if state is None:
                check_convertible(tensor, "DisposeScope.include()")
                tensor.__class__ = TensorRef
                register_ref(tensor, self, user_site(), thread_state().counters)
            elif state.owner is not self:
                move_state(state, self)
                state.counters.attached += 1
            refs.append(tensor)  # type: ignore[arg-type]
        return refs[0] if len(refs) == 1 else tuple(refs)

    @overload
    def exclude(self, tensor: torch.Tensor, /) -> torch.Tensor: ...
    @overload
    def exclude(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]: ...
    def exclude(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Give up ownership of refs this scope owns (TorchSharp ``Detach``); others ignored."""
        self.check_open()
        for tensor in tensors:
            state = state_of(tensor)
            if state is not None and state.owner is self and state.disposal is None:
                move_state(state, None)
                state.counters.detached += 1
        return _one_or_tuple(tensors)

    @overload
    def move_to_outer(self, tensor: torch.Tensor, /) -> torch.Tensor: ...
    @overload
    def move_to_outer(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]: ...
    def move_to_outer(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Move refs this scope owns to the outer scope (unowned if none); others ignored."""
        self.check_open()
        outer = self._outer.resolve() if self._outer is not None else None
        for tensor in tensors:
            state = state_of(tensor)
            if state is not None and state.owner is self and state.disposal is None:
                move_state(state, outer)
                if outer is None:
                    state.counters.detached += 1
        return _one_or_tuple(tensors)

    def dispose_everything(self) -> None:
        """Dispose every ref this scope owns now; the scope stays open."""
        self.check_open()
        dispose_states(
            self.owned_states(),
            reason=f"by dispose_everything() of {self.words()}",
            owner_thread=self._thread,
        )

    def dispose_everything_but(self, *keep: Any) -> Any:
        """Dispose every owned ref not in ``keep`` (tensors or iterables of tensors).

        Kept refs stay owned and die at ``close()``; refs in ``keep`` this scope does not own
        are left alone. Returns ``keep`` (the single argument when given one).
        """
        self.check_open()
        kept = {id(t) for t in _flatten_keep(keep)}
        doomed = [s for s in self.owned_states() if s.key not in kept]
        dispose_states(
            doomed,
            reason=f"by dispose_everything_but() of {self.words()}",
            owner_thread=self._thread,
        )
        return keep[0] if len(keep) == 1 else keep


def _one_or_tuple(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return tensors[0] if len(tensors) == 1 else tensors


def _flatten_keep(keep: Iterable[Any]) -> Iterator[Any]:
    for item in keep:
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, Iterable) and not isinstance(item, (str, bytes)):
            yield from _flatten_keep(item)
        else:
            raise ArgumentTypeError(
                "tensorscope.scope: dispose_everything_but() keeps tensors or iterables of "
                f"tensors; got {type(item).__name__}."
            )


def _hand_over(value: Any, inner: DisposeScope, to: Owner | None) -> None:
    """Refs of ``inner`` found in ``value`` (what a scoped function returns or yields) move to
    ``to`` (unowned if ``None``)."""
    for tensor in tensors_in(value):
        state = state_of(tensor)
        if state is not None and state.owner is inner and state.disposal is None:
            move_state(state, to)
            if to is None:
                state.counters.detached += 1


@contextlib.contextmanager
def _body_running(scope: DisposeScope) -> Iterator[list[Any]]:
    """One stretch of a scoped generator's body: ``scope`` is current on this thread until the
    body yields (or ends); what the caller list gets is handed to the consumer's scope."""
    consumer = CURRENT_SCOPE.get()
    consumer = consumer.resolve() if consumer is not None else None
    state = thread_state()
    if not scope._entered:  # the first stretch: the scope opens
        scope._outer = consumer
        scope._entered = True
        scope._thread = state
    token = CURRENT_SCOPE.set(scope)
    _intercept.acquire(state)
    handed: list[Any] = []
    try:
        yield handed
        if not scope._closed:
            _hand_over(handed, scope, consumer)
    finally:
        CURRENT_SCOPE.reset(token)
        if not scope._closed:  # a close releases its thread's hold itself
            _intercept.release(state)


def _scoped_generator(
    func: Callable[..., Generator[Any, Any, Any]], name: str | None, report_leaks: bool
) -> Callable[..., Generator[Any, Any, Any]]:
    """``@ts.scope()`` on a generator function (torch's decorated-generator protocol: the body
    runs in the context, the consumer does not)."""

    @functools.wraps(func)
    def scoped(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        generator = func(*args, **kwargs)
        inner = DisposeScope(name, report_leaks=report_leaks)
        try:
            with _body_running(inner) as handed:
                handed.append(response := generator.send(None))
            while True:
                try:
                    request = yield response
                except GeneratorExit:
                    with _body_running(inner):
                        generator.close()
                    raise
                except BaseException:
                    with _body_running(inner) as handed:
                        handed.append(response := generator.throw(*sys.exc_info()))
                else:
                    with _body_running(inner) as handed:
                        handed.append(response := generator.send(request))
        except StopIteration as stop:
            with _body_running(inner) as handed:
                handed.append(stop.value)
            return stop.value
        finally:
            if inner._entered:
                with _body_running(inner):
                    inner.close()

    return scoped


def scope(name: str | None = None, *, report_leaks: bool = False) -> DisposeScope:
    """A new :class:`DisposeScope` (enter it with ``with``, or use it as a decorator).

    Args:
        name: shown in error messages and reports.
        report_leaks: at close, warn (:class:`~tensorscope.LeakWarning`) about owned refs still
            referenced from outside the scope, with their creation sites; also in ``s.leaks``.

    Example:
        >>> import torch, tensorscope as ts
        >>> with ts.scope(name="step"):
        ...     y = torch.ones(3).sum()
        >>> y.is_disposed
        True
    """
    return DisposeScope(name, report_leaks=report_leaks)


def current_scope() -> DisposeScope | None:
    """The innermost open scope of this thread / asyncio task, or ``None``."""
    current = CURRENT_SCOPE.get()
    return current.resolve() if current is not None else None  # type: ignore[return-value]


def _require_scope(what: str) -> DisposeScope:
    current = current_scope()
    if current is None:
        raise ScopeError(
            f"tensorscope.scope: ts.{what}() needs an open scope; use it inside `with ts.scope():`."
        )
    return current


def dispose_everything() -> None:
    """Dispose every ref the current scope owns (``ScopeError`` with no scope open)."""
    _require_scope("dispose_everything").dispose_everything()


def dispose_everything_but(*keep: Any) -> Any:
    """``current_scope().dispose_everything_but(*keep)`` (``ScopeError`` with no scope open)."""
    return _require_scope("dispose_everything_but").dispose_everything_but(*keep)
