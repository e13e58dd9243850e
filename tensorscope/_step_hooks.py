"""Our global optimizer-step hooks: registered with torch once, never removed.

# NOTE [global step hooks and threads]
# torch keeps its global optimizer-step hooks in an OrderedDict and ``Optimizer.step`` iterates
# it lazily, calling each hook inside the iteration. A hook registered or removed by one thread
# while another thread's step is between two hooks fails that step with "OrderedDict mutated
# during iteration" (seen: two threads each fitting its own model, one calling ``fit.remove()``
# while the other stepped). So the recorder, ``ts.fit`` and ``tensorscope plan`` never touch
# torch's dict after the first use: one pre- and one post-hook stay registered for the life of
# the process and run our own hooks from a tuple that is replaced, never mutated, under a lock
# (a step iterates the tuple it read). They are registered when this module is imported (with
# ``tensorscope``), so no later first use mutates torch's dict either; with none of ours active
# they cost a call each per step. Ours run in rank order, then in the order they were added:
# the recorder notes a step's optimizer state (rank 0) before ``ts.fit`` or the plan command
# acts on it (rank 1).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

__all__ = ["StepHook", "StepHookHandle", "active", "add_post", "add_pre"]

StepHook = Callable[[torch.optim.Optimizer, Any, Any], None]

_lock = threading.Lock()
_order = itertools.count()
_pre: tuple[tuple[int, int, StepHook], ...] = ()
_post: tuple[tuple[int, int, StepHook], ...] = ()
_registered: list[Any] = []  # torch's handles for our two hooks, kept for the process's life


class StepHookHandle:
    """Removes one of our step hooks; ``remove()`` is idempotent and safe from any thread."""

    def __init__(self, key: int, post: bool) -> None:
        self._key = key
        self._post = post

    def remove(self) -> None:
        global _pre, _post
        with _lock:
            if self._post:
                _post = tuple(entry for entry in _post if entry[1] != self._key)
            else:
                _pre = tuple(entry for entry in _pre if entry[1] != self._key)


def _run_pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for _, _, hook in _pre:
        hook(optimizer, args, kwargs)


def _run_post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for _, _, hook in _post:
        hook(optimizer, args, kwargs)


def _register_once() -> None:
    if not _registered:
        _registered.append(register_optimizer_step_pre_hook(_run_pre))
        _registered.append(register_optimizer_step_post_hook(_run_post))


_register_once()


def _add(hook: StepHook, rank: int, post: bool) -> StepHookHandle:
    global _pre, _post
    with _lock:
        entry = (rank, next(_order), hook)
        if post:
            _post = tuple(sorted((*_post, entry), key=lambda e: (e[0], e[1])))
        else:
            _pre = tuple(sorted((*_pre, entry), key=lambda e: (e[0], e[1])))
    return StepHookHandle(entry[1], post)


def add_pre(hook: StepHook, rank: int = 0) -> StepHookHandle:
    """Run ``hook(optimizer, args, kwargs)`` before every optimizer step of the process."""
    return _add(hook, rank, post=False)


def add_post(hook: StepHook, rank: int = 0) -> StepHookHandle:
    """Run ``hook(optimizer, args, kwargs)`` after every optimizer step of the process."""
    return _add(hook, rank, post=True)


def active() -> int:
    """How many of our step hooks are added (tests check that none is left behind)."""
    return len(_pre) + len(_post)
