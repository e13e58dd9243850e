"""Per-thread state: the one place that says what tensorscope keeps for each thread.

# NOTE [per-thread state, in one table]
# ``ThreadState`` (one per thread, ``thread_state()``) and the ``CURRENT_SCOPE`` context variable
# (one per thread *and* asyncio task) are everything that varies by thread:
#
# | field              | meaning                                                     | written by |
# |--------------------|-------------------------------------------------------------|------------|
# | CURRENT_SCOPE      | innermost scope entered in this thread/task (maybe closed:  | scope.py   |
# |                    | ``Owner.resolve()`` walks out to the nearest open one)      |            |
# | counters           | ``ts.stats()``: refs this thread created/disposed/moved     | _state.py  |
# | mode               | the residency manager's dispatch mode for this thread       | _intercept |
# |                    | (``Interceptor``), made once                                |            |
# | pushed             | ``mode`` is on this thread's torch dispatch stack           | here       |
# | key_on             | the scope engines' key is included on this thread           | here       |
# | scope_users        | open scopes entered on this thread                          | scope.py   |
# | residency_users    | 1 while the residency manager routes this thread's ops      | residency  |
# |                    | (``ts.manage()`` or a demotion ran here; the manager itself |            |
# |                    | is process-wide: ``_slot.ACTIVE`` while it manages anything)|            |
# | popped_for         | why ownership is paused (the key excluded; the mode popped  | here       |
# |                    | unless residency keeps it): "optimizer" (a step: nothing it |            |
# |                    | makes is owned), "backward" (a ref's ``backward()``), None  |            |
# | regions            | open ``record_function`` regions seen by the mode; True for | _intercept |
# |                    | torch.optim's step/zero_grad regions                        |            |
# | unowned_depth      | > 0 inside such an optimizer region (results not owned)     | _intercept |
# | jit_optimize       | TorchScript's optimisation setting, saved while scopes are  | here       |
# |                    | open (off meanwhile: see the NOTE on TorchScript)           |            |
# | pending            | tensors whose memory a close on another thread disposed;    | ref.py     |
# |                    | released by this thread at its next op or scope event       |            |
#
# Whether an op result becomes a ref owned by a scope is decided, in this order, by: the key
# being included (``key_on``: a scope open, ownership not paused by ``popped_for``); the op
# being top-level and not ``detach``/``alias`` (_adopt.py's NOTE); the op not mutating its
# inputs (an in-place op's result is its input); an open scope
# (``CURRENT_SCOPE`` resolved); the result being a plain ``torch.Tensor`` that is not one of the
# op's inputs (no-op conversions under inference mode return their input); no state maker on
# the call stack (``_sites.NOT_OWNED``); and, for a gradient being made by autograd's
# AccumulateGrad, nobody (autograd keeps it).
#
# NOTE [TorchScript]
# TorchScript's graph executor optimises a scripted or traced function on its first calls, and
# constant propagation runs ops whose results become constants of the compiled graph: made while
# a scope is open, they were owned and emptied at its exit, and every later call computed with
# empty tensors (silently wrong results). So while a scope is open on a thread, TorchScript's
# (thread-local) optimisation is off there and restored when the last scope closes; and nothing
# is owned while ``torch.jit.trace`` records (its tensors become the trace's constants).
#
# NOTE [cross-thread close]
# A scope may be closed from another thread. Its refs are disposed at once (class switch,
# statistics, version counters: every later use raises), but their memory is released by the
# scope's own thread, at its next op or scope event: freeing a storage while that thread's
# kernel reads it would crash or corrupt (a dispatch mode runs before an op's kernel, never in
# the middle of one). A thread that has ended releases nothing more, so the closer does it.

Layer 5: imports only layers 0-4.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Literal

import torch

from tensorscope._engine import FAST
from tensorscope._layout import PENDING, SCOPES
from tensorscope._slot import ACTIVE
from tensorscope._state import Counters, Owner
from tensorscope._torch import (
    jit_optimize,
    mode_on_top,
    pop_mode,
    push_mode,
    set_scope_key_included,
)

if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CURRENT_SCOPE", "NATIVE_OPS", "ThreadState", "all_thread_states", "thread_state"]

# The C++ engine runs the residency manager's op path too (csrc/managed.cpp): the Interceptor
# is then never left on the mode stack; the engine pushes it for the ops Python must see.
NATIVE_OPS = FAST is not None and hasattr(FAST, "res_attach")

# The innermost scope entered in this thread / asyncio task (contextvars give both for free).
CURRENT_SCOPE: ContextVar[Owner | None] = ContextVar("tensorscope_current_scope", default=None)

PopReason = Literal["optimizer", "backward"]


class ThreadState:
    """Everything tensorscope keeps per thread (see the table in the module NOTE)."""

    __slots__ = (
        "__weakref__",
        "counters",
        "jit_optimize",
        "key_on",
        "mode",
        "mode_kept",
        "pending",
        "pending_lock",
        "popped_for",
        "pushed",
        "regions",
        "residency_users",
        "scope_users",
        "thread",
        "thread_id",
        "unowned_depth",
    )

    def __init__(self) -> None:
        self.counters = Counters()
        self.mode: TorchDispatchMode | None = None
        self.pushed = False
        self.key_on = False  # the scope engines' dispatch key is included on this thread
        self.jit_optimize: bool | None = None  # TorchScript's setting, saved while scopes are open
        self.mode_kept = False  # the mode stays pushed while popped_for (residency needs it)
        self.scope_users = 0
        self.residency_users = 0
        self.popped_for: PopReason | None = None
        self.regions: list[bool] = []
        self.unowned_depth = 0
        self.pending: list[torch.Tensor] = []
        self.pending_lock = threading.Lock()
        self.thread_id = threading.get_ident()
        self.thread = weakref.ref(threading.current_thread())

    # ------------------------------------------------------------------------------ queries
    @property
    def on_this_thread(self) -> bool:
        return self.thread_id == threading.get_ident()

    @property
    def alive(self) -> bool:
        """Whether the thread this state belongs to is still running."""
        thread = self.thread()
        return thread is not None and thread.is_alive()

    # -------------------------------------------------------- the mode and the C++ engine's key
    def _mode_wanted(self) -> bool:
        if self.mode is None or (self.popped_for is not None and not self.mode_kept):
            return False
        return self.residency_users > 0

    def _key_wanted(self) -> bool:
        return self.scope_users > 0 and self.popped_for is None

    def sync(self) -> None:
        """On this thread: push or pop the mode and include or exclude the C++ engine's key as
        what is open here needs. A mode pushed above ours and not yet exited keeps ours pushed
        (idle) until the next scope event."""
        mode = self.mode
        if self._mode_wanted():
            if not self.pushed and mode is not None:
                if NATIVE_OPS:  # the C++ op path hands the mode only the ops it must see
                    FAST.res_attach(mode)
                else:
                    push_mode(mode)
                self.pushed = True
        elif self.pushed and mode is not None and (NATIVE_OPS or mode_on_top(mode)):
            if NATIVE_OPS:
                FAST.res_attach(None)
            else:
                pop_mode()
            self.pushed = False
        if NATIVE_OPS:
            FAST.res_due(self.unowned_depth > 0)
        self._sync_jit()
        key = self._key_wanted()
        if key != self.key_on:
            if key and FAST is not None:
                FAST.bind_thread(self)  # the engine reads this thread's state (csrc/fast.cpp)
            set_scope_key_included(key)
            self.key_on = key

    def _sync_jit(self) -> None:
        """TorchScript runs unoptimised on this thread while a scope is open here: its graph
        optimisation runs ops to fold constants into the compiled graph, and a scope would own
        (then empty) those constants (see the NOTE on TorchScript)."""
        if self.scope_users > 0 and self.jit_optimize is None:
            self.jit_optimize = jit_optimize(False)
        elif self.scope_users == 0 and self.jit_optimize is not None:
            jit_optimize(self.jit_optimize)
            self.jit_optimize = None

    def pop_for(self, reason: PopReason, keep_mode: bool = False) -> bool:
        """Stop owning results for a while (an optimizer step, a backward pass): the key off,
        the mode popped unless ``keep_mode`` (the residency manager needs it); True if paused."""
        if self.popped_for is not None or not (self.pushed or self.key_on):
            return False
        if self.pushed and not keep_mode and not self.mode_is_innermost():
            return False
        self.popped_for = reason
        self.mode_kept = keep_mode
        self.sync()
        return True

    def mode_is_innermost(self) -> bool:
        """Whether the residency mode can be popped now: the innermost mode on this thread's
        stack (the C++ op path keeps it off the stack: always)."""
        return self.mode is not None and (NATIVE_OPS or mode_on_top(self.mode))

    def resume(self, step_completed: bool = False) -> None:
        """Undo ``pop_for`` (also after a step that raised, at the next scope event).

        torch.optim opens its record_function region before the pre-hook pops the mode and
        closes it after the post-hook pushes it back; a step that raised closed it unseen, so
        its entry is settled here unless the step completed.
        """
        if self.popped_for is None:
            return
        # A kept mode saw the region close itself; a popped one did not.
        unseen = self.popped_for == "optimizer" and not step_completed and not self.mode_kept
        settle = unseen and self.regions
        if settle and self.regions.pop():
            self.unowned_depth -= 1
        self.popped_for = None
        self.mode_kept = False
        self.sync()

    def take_pending(self) -> list[torch.Tensor]:
        """The tensors left for this thread to release (see the NOTE on cross-thread close)."""
        if not self.pending:
            return []
        with self.pending_lock:
            pending, self.pending = self.pending, []
            if NATIVE_OPS and pending:
                FAST.res_counter(PENDING, -1)
        return pending

    def defer(self, tensors: list[torch.Tensor]) -> None:
        with self.pending_lock:
            if NATIVE_OPS and not self.pending and tensors:
                FAST.res_counter(PENDING, 1)  # the C++ op path hands ops to Python meanwhile
            self.pending.extend(tensors)


class _Local(threading.local):
    def __init__(self) -> None:
        self.state = ThreadState()
        _ALL.add(self.state)


_ALL: weakref.WeakSet[ThreadState] = weakref.WeakSet()
_local = _Local()


def thread_state() -> ThreadState:
    """This thread's :class:`ThreadState`."""
    return _local.state


def owning_scope(state: ThreadState) -> Owner | None:
    """The scope that owns what creators outside the dispatcher (``torch.frombuffer``, compiled
    graphs) make on ``state``'s thread right now: the open current scope, unless the mode is
    popped or an optimizer region runs (the rules of the table above); else None."""
    if state.scope_users == 0 or state.popped_for is not None or state.unowned_depth:
        return None
    scope = CURRENT_SCOPE.get()
    return scope.resolve() if scope is not None else None


def _reset_after_fork() -> None:
    """In a child process (a DataLoader worker forked inside a scope): start with no scope open,
    the mode popped and no residency routing; what the child makes is its own, as in plain
    PyTorch (a batch a worker made inside the parent's scope came back as that scope's ref)."""
    state = thread_state()
    if NATIVE_OPS and hasattr(FAST, "res_forget_threads"):
        FAST.res_forget_threads()  # the parent's other threads are not here
    if state.pushed and NATIVE_OPS:
        FAST.res_attach(None)
    elif state.pushed and state.mode is not None and mode_on_top(state.mode):
        pop_mode()
    if state.key_on:
        set_scope_key_included(False)
        state.key_on = False
    state.pushed = False
    state.mode_kept = False
    if NATIVE_OPS and state.scope_users:
        FAST.res_counter(SCOPES, -state.scope_users)
    state.scope_users = state.residency_users = state.unowned_depth = 0
    state._sync_jit()  # no scope open: TorchScript's setting back
    state.popped_for = None
    state.regions = []
    state.pending = []
    state.pending_lock = threading.Lock()
    CURRENT_SCOPE.set(None)
    ACTIVE.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def all_thread_states() -> list[ThreadState]:
    """The states of threads that are alive or still referenced."""
    return list(_ALL)


@contextlib.contextmanager
def mode_popped(reason: PopReason, keep_mode: bool = False) -> Iterator[None]:
    """Run a block without owning results on this thread (see ``ThreadState.pop_for``)."""
    state = thread_state()
    popped = state.pop_for(reason, keep_mode)
    try:
        yield
    finally:
        if popped and state.popped_for == reason:
            state.resume()
