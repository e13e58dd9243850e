"""Readers of every gradient that run between backward and ``optimizer.step()`` -- torch's
gradient clipping -- told to ts.fit, which may have applied and freed those gradients already.

# NOTE [a step that reads gradients after the recorded one]
# ts.fit frees gradients at their update (optimizer-in-backward) only when the recorded step
# read none outside backward and the optimizer step (decider.py ``why_grads_kept``). A loop can
# change later: clipping switched on after a warm-up, gradient accumulation from some step on.
# Then the updates inside backward have already run when the reader comes: clip_grad_norm_
# finds no gradient and clips nothing; a second micro-batch's forward runs on weights the
# first backward updated. Neither can be undone (the updates are applied), so it is said at
# once -- a FitWarning naming the reader and what was updated -- and the decision is taken
# again with gradients kept, so every later step is exact (handle.py ``_late_reader``). The
# second forward is seen by the fit itself (its forward pre-hook); clipping through
# ``torch.nn.utils`` (module attribute lookups, as HF's Trainer, accelerate and Lightning make
# them) is seen by wrapping those functions here, once, while a fit frees gradients: a name
# imported before (``from torch.nn.utils import clip_grad_norm_``) is the unwrapped function,
# which only ts.fit's docs can warn about (docs/fit.md).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

__all__ = ["READERS", "listen"]

READERS = ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_", "clip_grad_norm")

_listeners: weakref.WeakSet[Any] = weakref.WeakSet()  # objects with a read_all(name, params)
_lock = threading.Lock()
_installed = False


class _Handle:
    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)

    def remove(self) -> None:
        owner = self._owner()
        if owner is not None:
            _listeners.discard(owner)


def listen(owner: Any) -> _Handle:
    """Call ``owner.read_all(name, parameters)`` before each gradient reader runs (until the
    handle's ``remove()``, or ``owner`` is freed).

    Example:
        >>> class Owner:
        ...     def read_all(self, name, params): print(name, len(params))
        >>> owner = Owner(); handle = listen(owner)
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.ones(2)
        >>> _ = torch.nn.utils.clip_grad_norm_([p], 1.0)
        clip_grad_norm_ 1
        >>> handle.remove()
    """
    _install()
    _listeners.add(owner)
    return _Handle(owner)


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        for name in READERS:
            original = getattr(torch.nn.utils.clip_grad, name, None)
            if original is None:
                continue
            reader = _wrap(name, original)
            for module in (torch.nn.utils.clip_grad, torch.nn.utils):
                if getattr(module, name, None) is original:
                    setattr(module, name, reader)
        _installed = True


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reader(*args: Any, **kwargs: Any) -> Any:
        if _listeners and (args or "parameters" in kwargs):
            given = args[0] if args else kwargs["parameters"]
            params = [given] if isinstance(given, torch.Tensor) else list(given)
            for owner in list(_listeners):
                owner.read_all(name, params)
            if args:
                args = (params, *args[1:])
            else:
                kwargs["parameters"] = params
        return original(*args, **kwargs)

    reader.__dict__["_tensorscope_reader"] = original
    return reader
