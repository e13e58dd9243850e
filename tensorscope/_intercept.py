"""The interceptor: the residency manager's dispatch mode, and the hooks scopes install once.

# NOTE [why a dispatch mode for residency]
# Scopes own results on the DeferredInit key (_adopt.py's NOTE): above Autograd, top-level ops
# only. The residency manager must see every decomposed op on managed tensors, their backward
# and the optimizer's ops, so it routes a thread's ops through this ``TorchDispatchMode``, pushed
# while the manager manages something on that thread and popped when it stops. With the C++
# engine the mode is not left pushed: the engine's Fake-key fallback sees the same ops, runs the
# resident ones natively and pushes this mode for one op at a time for the rest
# (csrc/managed.cpp, residency/native.py, docs/design.md §14).
#
# NOTE [hot path]
# Every op pays for this handler, so it does the least it can: one dict lookup finds the op's
# kind (the op table, _optable.py, keyed by id: an OpOverload's hash is Python code), and
# ``func._op`` skips OpOverload's Python ``__call__``. How the mode meets torch.compile (no
# dynamo-disabling shim; our frames skipped instead) is the base class's (_modes.py's NOTE).

Layer 11: imports only layers 0-10.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tensorscope import _aliases, _compiled, _fallback, _keepers, _optimizer
from tensorscope._adopt import accumulate_grad_leaf, adopt, adopt_at, adopt_fresh, adopt_result
from tensorscope._engine import FAST
from tensorscope._layout import SCOPES
from tensorscope._modes import DispatchMode, skip_in_dynamo
from tensorscope._optable import (
    ALIAS,
    DETACH,
    ENTER,
    GRAD_CANDIDATE,
    PLAIN,
    TABLE,
    op_info,
)
from tensorscope._sites import capture_site, site_verdicts
from tensorscope._slot import ACTIVE
from tensorscope._state import STATES, Counters, Owner, RefState, on_ref_death, register_ref
from tensorscope._thread import (
    CURRENT_SCOPE,
    NATIVE_OPS,
    ThreadState,
    owning_scope,
    thread_state,
)
from tensorscope._torch import ORIGINAL_FROMBUFFER, graph_task_id, treat_as_plain_for_tracing
from tensorscope.ref import TensorRef, release_pending, stock_stand_ins, unown_buffer

__all__ = [
    "Interceptor",
    "accumulate_grad_leaf",
    "acquire",
    "release",
    "settle",
]

# NOTE [bare aliases]
# ``detach`` and ``alias`` outside autograd's engine run unseen (no bytes read, none made):
# torch's C functions make ``nn.Parameter``s (``_make_subclass``) and subclasses from such
# aliases with the mode stack stashed, so the mode never saw them there; the C++ op path, a
# dispatch key that no stash hides, passes them through likewise (csrc/managed.cpp). Inside
# autograd's engine ``detach`` may be a ``.grad`` in the making (``GRAD_CANDIDATE``): the op
# table's kinds ``ALIAS`` and ``DETACH``.


class Interceptor(DispatchMode):
    """Routes a thread's ops through the residency manager; one instance per thread."""

    def __init__(self, state: ThreadState) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state = state

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        state = self.state
        if state.pending:
            release_pending(state)
        info = TABLE.get(id(func))
        if info is None:
            info = op_info(func)
        kind = info.kind
        if ALIAS <= kind <= DETACH:  # NOTE [bare aliases]
            if graph_task_id() == -1:
                return func._op(*args, **kwargs) if kwargs else func._op(*args)
            kind = GRAD_CANDIDATE if kind == DETACH else PLAIN
        if ACTIVE:
            # Results of ops on managed tensors are managed inside scopes and optimizer steps.
            due = state.unowned_depth > 0 or self._scope() is not None
            out = ACTIVE[0].run_op(func, kind, args, kwargs, due)
        else:
            out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        if kind >= ENTER:  # torch.optim's regions: what a step makes is not owned
            if kind == ENTER:
                optimizer = isinstance(args[0], str) and args[0].startswith("Optimizer.")
                state.regions.append(optimizer)
                state.unowned_depth += optimizer
            elif state.regions and state.regions.pop():
                state.unowned_depth -= 1
            if NATIVE_OPS:
                FAST.res_due(state.unowned_depth > 0)
        return out

    def _scope(self) -> Owner | None:
        if self.state.unowned_depth:
            return None
        scope = CURRENT_SCOPE.get()
        return scope.resolve() if scope is not None else None


# ---------------------------------------------------------------------------- global hooks
_global_hooks: list[Any] = []
# At import, not at the first scope: a function compiled (and run) before any scope opens is
# called inside scopes later, and its graphs must own their outputs there (_compiled.py).
_compiled.install()


def _install_global_hooks() -> None:
    if _global_hooks:
        return
    # Buffers registered inside a scope (BatchNorm's running stats, caches assigned to a
    # registered buffer name) must outlive it; parameters are handled when they are created.
    _global_hooks.append(
        torch.nn.modules.module.register_module_buffer_registration_hook(unown_buffer)
    )
    _global_hooks.extend(_optimizer.install_hooks())
    _keepers.install()
    # torch.frombuffer is the one creator that bypasses the dispatcher (DESIGN.md).
    torch.frombuffer = _frombuffer
    _aliases.install()  # NOTE [aliases user code asks for]
    _skip_our_frames_in_dynamo()  # (the mode's own handler: by its base class, _modes.py)
    treat_as_plain_for_tracing(TensorRef)
    _fallback.install(python_engine=FAST is None)
    if FAST is not None:
        # The engine does adopt_at's work itself in the common case (csrc/fast.cpp).
        adoption = (TensorRef, RefState, Counters, on_ref_death, STATES, CURRENT_SCOPE)
        FAST.set_hook(adopt_result, *site_verdicts(), adoption)


def _skip_our_frames_in_dynamo() -> None:
    """Tell torch.compile never to trace tensorscope's per-op frames (they are not user code)."""
    skip_in_dynamo(
        Interceptor._scope,
        _fallback._fallback,
        _fallback._fresh,
        _fallback._is_input,
        adopt,
        accumulate_grad_leaf,
        capture_site,
        register_ref,
        release_pending,
        adopt_fresh,
        adopt_result,
        adopt_at,
    )


@functools.wraps(ORIGINAL_FROMBUFFER)
def _frombuffer(*args: Any, **kwargs: Any) -> torch.Tensor:
    out = ORIGINAL_FROMBUFFER(*args, **kwargs)
    if type(out) is torch.Tensor:
        state = thread_state()
        scope = owning_scope(state)
        if scope is not None:
            adopt(out, scope, state.counters)
    return out


# ------------------------------------------------------------------------ users of the mode
def acquire(state: ThreadState, *, residency: bool = False) -> None:
    """A scope (or a ``ts.manage()`` handle) of this thread needs the mode: push it."""
    _install_global_hooks()
    _fallback.register_new_ops()
    stock_stand_ins()
    if state.pending:
        release_pending(state)
    state.resume()  # an optimizer step that raised left it popped
    if residency:
        state.residency_users += 1
    else:
        state.scope_users += 1
        if NATIVE_OPS:  # results of ops on managed tensors may be due: the Python op path
            FAST.res_counter(SCOPES, 1)
    if state.mode is None:
        state.mode = Interceptor(state)
    state.sync()


def release(state: ThreadState, *, residency: bool = False) -> None:
    """A user of ``state``'s mode went away; the last one pops it.

    Popping must happen on that thread (the mode stack is thread-local): a scope closed from
    another thread leaves the mode pushed but idle (no scope is current there, so it returns
    plain results) until that thread's next op or scope event.
    """
    if residency:
        state.residency_users = max(0, state.residency_users - 1)
    elif state.scope_users > 0:
        state.scope_users -= 1
        if NATIVE_OPS:
            FAST.res_counter(SCOPES, -1)
    settle(state)


def settle(state: ThreadState) -> None:
    """On ``state``'s own thread: release what other threads left to it, put back a mode an
    optimizer step left popped, and pop the mode if nothing needs it any more."""
    if not state.on_this_thread:
        return
    if state.pending:
        release_pending(state)
    state.resume()
    state.sync()
