"""Which models and optimizers are fitted now: one ``ts.fit`` each at a time."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from tensorscope.errors import InvalidArgumentError

__all__ = ["claim", "release"]


class _Fitted(Protocol):
    @property
    def removed(self) -> bool: ...


F = TypeVar("F", bound=_Fitted)

_lock = threading.Lock()
# model or optimizer -> its fit, both weakly: a fit lives as long as its model's hooks do
_FITTED: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def claim(keys: tuple[Any, Any], make: Callable[[], F]) -> F:
    """``make()`` the fit of ``keys`` (the model, the optimizer) and note it as theirs.

    Raises:
        InvalidArgumentError: one of them is fitted already (and not removed).
    """
    with _lock:
        for key, what in zip(keys, ("model", "optimizer"), strict=True):
            ref = _FITTED.get(key)
            other = ref() if ref is not None else None
            if other is not None and not other.removed:
                raise InvalidArgumentError(
                    f"tensorscope.fit: this {what} ({type(key).__name__}) is already fitted "
                    f"({other!r}); call its remove() before ts.fit again"
                )
        made = make()
        for key in keys:
            _FITTED[key] = weakref.ref(made)
    return made


def release(fit: object, keys: tuple[Any, Any]) -> None:
    """``keys`` are not ``fit``'s any more."""
    with _lock:
        for key in keys:
            ref = _FITTED.get(key)
            if ref is not None and ref() is fit:
                del _FITTED[key]
