"""The interceptor: one TorchDispatchMode per thread that sees every op while scopes are open.

# NOTE [why a dispatch mode]
# Only a TorchDispatchMode sees every tensor a step creates: factories, module internals, the
# ops autograd runs in backward and those of optimizer steps (DESIGN.md, measured). It is pushed
# when the first scope of a thread opens and popped when the last closes (asyncio tasks of one
# thread share it; each reads its own current scope from a contextvar), so with no scope open
# torch runs untouched.
#
# NOTE [hot path]
# Every op pays for this handler, so it does the least it can: one dict lookup classifies the op
# (cached per OpOverload from its schema), ``func._op`` skips OpOverload's Python ``__call__``,
# and the results get a class switch and a RefState, nothing else. ``_should_skip_dynamo``
# returns False so torch does not wrap ``__torch_dispatch__`` in a dynamo-disabling shim (that
# shim imports torch._dynamo and costs ~1 µs per op).
#
# NOTE [what is never owned]
# Parameters and buffers are converted back to plain classes when created (ref.py); a leaf's
# ``.grad`` is recognised while autograd's AccumulateGrad node runs (the op that makes the grad
# runs inside it: detach when it steals the incoming gradient, clone/empty_strided when it
# copies, add when it accumulates out of place) and is owned by the leaf's scope, or by nobody
# when the leaf is not owned (parameters); optimizer steps run inside the record_function
# "Optimizer.step#..." that torch.optim opens around every step, and nothing created there is
# owned (that is where optimizer state is born). The record_function exit runs even when the
# step raises, so ownership resumes reliably.
#
# NOTE [optimizer steps run without the mode]
# Since nothing an optimizer step creates is owned, the mode is popped for the step (torch.optim's
# global step pre-hook) and pushed back by the post-hook: a single-tensor Adam step is half the
# ops of a small training step, and each would pay the mode's ~4 µs for nothing. A step that
# raises skips the post-hook; the next scope event of the thread (a scope closing or opening, the
# next optimizer step) puts the mode back, so at worst the tensors created between a caught
# optimizer exception and that event are plain (not owned), never lost.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from tensorscope import _saved
from tensorscope._sites import capture_site
from tensorscope._state import (
    CURRENT_SCOPE,
    ORIGINAL_FROMBUFFER,
    STATES,
    Counters,
    RefState,
    ThreadData,
    _on_ref_death,
    thread_data,
)
from tensorscope.ref import TensorRef, grad_owner_for, mark_grad_of, resolve_open, unown_buffer

if TYPE_CHECKING:
    from tensorscope.residency import ResidencyManager
    from tensorscope.scope import DisposeScope as Owner

__all__ = ["Interceptor", "acquire", "release"]

_Tensor = torch.Tensor
_PLAIN, _MUTATING, _GRAD_CANDIDATE, _RECORD_ENTER, _RECORD_EXIT = 0, 1, 2, 3, 4
_KINDS: dict[Any, int] = {}
_GRAD_MAKERS = {
    "aten::detach",
    "aten::clone",
    "aten::add",
    "aten::empty_strided",
    "aten::new_empty_strided",
    "aten::_to_copy",
}
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node


def _classify(func: Any) -> int:
    schema = func._schema
    kind = _PLAIN
    if any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        kind = _MUTATING
    elif schema.name in _GRAD_MAKERS:
        kind = _GRAD_CANDIDATE
    elif schema.name == "profiler::_record_function_enter_new":
        kind = _RECORD_ENTER
    elif schema.name == "profiler::_record_function_exit":
        kind = _RECORD_EXIT
    _KINDS[func] = kind
    return kind


def adopt(tensor: torch.Tensor, owner: Owner, counters: Counters) -> RefState:
    """Make a fresh op result a ref owned by ``owner`` (the hot path: keep it lean)."""
    tensor.__class__ = TensorRef
    state = RefState(tensor, _on_ref_death)
    key = id(tensor)
    state.key = key
    state.owner = owner
    state.site = capture_site(2)
    state.counters = counters
    state.disposal = None
    state.grad_of = None
    STATES[key] = state
    owner._owned[key] = state
    counters.created_in_scope += 1
    return state


class Interceptor(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Makes op results refs of the current scope; one instance per thread."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, counters: Counters) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counters = counters
        # One entry per open record_function: True for torch.optim's step/zero_grad regions.
        self.records: list[bool] = []
        self.paused = 0
        # The residency manager, while managed tensors are used on this thread.
        self.manager: ResidencyManager | None = None

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kind = _KINDS.get(func)
        if kind is None:
            kind = _classify(func)
        if self.manager is not None:
            out = self._run_managed(self.manager, func, kind, args, kwargs)
        else:
            out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        if kind:
            if kind == _MUTATING:
                return out
            if kind == _GRAD_CANDIDATE:
                if _graph_task_id() != -1 and self._adopted_as_grad(out):
                    return out
            elif kind == _RECORD_ENTER:
                optimizer = isinstance(args[0], str) and args[0].startswith("Optimizer.")
                self.records.append(optimizer)
                self.paused += optimizer
                return out
            else:  # _RECORD_EXIT
                if self.records and self.records.pop():
                    self.paused -= 1
                return out
        if self.paused:
            return out
        scope = CURRENT_SCOPE.get()
        if scope is None:
            return out
        if scope._closed:
            scope = resolve_open(scope)
            if scope is None:
                return out
        kind_out = type(out)
        if kind_out is _Tensor:
            adopt(out, scope, self.counters)
        elif kind_out is tuple or kind_out is list:
            for item in out:
                if type(item) is _Tensor:
                    adopt(item, scope, self.counters)
        return out

    def _run_managed(
        self,
        manager: ResidencyManager,
        func: Any,
        kind: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
    ) -> Any:
        """Run ``func`` with its managed operands resident; manage what it creates if due."""
        operands = manager.operands(args, kwargs)
        if not operands:
            return func._op(*args, **kwargs) if kwargs else func._op(*args)
        group = 0
        if kind == _MUTATING:
            manage_results = False
        elif (
            kind == _GRAD_CANDIDATE
            and _graph_task_id() != -1
            and (type(node := _current_node()) is _ACCUMULATE_GRAD)
        ):
            leaf = manager.placement_of(node.variable)  # type: ignore[attr-defined]
            manage_results = leaf is not None
            group = leaf.uid if leaf is not None else 0
        else:
            manage_results = self.paused > 0 or resolve_open(CURRENT_SCOPE.get()) is not None
        estimate = manager.estimate_results(func, args, kwargs or {}) if manage_results else 0
        manager.before_op(func, operands, estimate)
        out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        manager.after_op(func, operands, out, manage_results, kind == _MUTATING, group)
        return out

    def _adopted_as_grad(self, out: Any) -> bool:
        """True when ``out`` is a ``.grad`` in the making (then it was handled here)."""
        node = _current_node()
        if type(node) is not _ACCUMULATE_GRAD or type(out) is not _Tensor:
            return False
        leaf = node.variable  # type: ignore[attr-defined]
        owner = grad_owner_for(leaf)
        if owner is not None:
            mark_grad_of(adopt(out, owner, self.counters), leaf)
        return True  # else: the gradient of a parameter or unowned tensor stays plain


_global_hooks: list[Any] = []


def _install_global_hooks() -> None:
    if _global_hooks:
        return
    # Buffers registered inside a scope (BatchNorm's running stats, caches assigned to a
    # registered buffer name) must outlive it; parameters are handled when they are created.
    _global_hooks.append(
        torch.nn.modules.module.register_module_buffer_registration_hook(unown_buffer)
    )
    _global_hooks.append(register_optimizer_step_pre_hook(_before_step))
    _global_hooks.append(register_optimizer_step_post_hook(_after_step))
    # torch.frombuffer is the one creator that bypasses the dispatcher (DESIGN.md).
    torch.frombuffer = _frombuffer


_original_frombuffer = ORIGINAL_FROMBUFFER


@functools.wraps(_original_frombuffer)
def _frombuffer(*args: Any, **kwargs: Any) -> torch.Tensor:
    out = _original_frombuffer(*args, **kwargs)
    data = thread_data()
    interceptor = data.interceptor
    if data.pushed and not data.suspended and interceptor is not None and not interceptor.paused:
        scope = resolve_open(CURRENT_SCOPE.get())
        if scope is not None and type(out) is torch.Tensor:
            adopt(out, scope, data.counters)
    return out


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    data = thread_data()
    if data.suspended:
        _resume(data)  # the previous step raised and the exception was caught
    interceptor = data.interceptor
    if interceptor is not None and interceptor.manager is not None:
        return  # managed parameters, grads and state are used here: keep intercepting
    if data.pushed and interceptor is not None and _mode_on_top(interceptor):
        torch._C._pop_torch_dispatch_stack(None)
        data.suspended = True


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    data = thread_data()
    if data.interceptor is not None and data.interceptor.manager is not None:
        data.interceptor.manager.iteration_boundary()
    if data.suspended and data.interceptor is not None:
        torch._C._push_on_torch_dispatch_stack(data.interceptor)
        data.suspended = False


def _resume(data: ThreadData) -> None:
    """Push back a mode left popped by an optimizer step that raised."""
    interceptor = data.interceptor
    data.suspended = False
    if interceptor is None:
        return
    torch._C._push_on_torch_dispatch_stack(interceptor)
    # The step's record_function exit ran while the mode was popped: settle its entry.
    if interceptor.records and interceptor.records[-1]:
        interceptor.records.pop()
        interceptor.paused -= 1


@contextlib.contextmanager
def backward_unintercepted() -> Iterator[None]:
    """Run a backward pass with this thread's interceptor popped (when nothing needs it).

    # NOTE [backward runs without the mode]
    # What backward creates is the engine's own: gradient temporaries it frees as it goes, and
    # ``.grad``s, which scopes never own anyway. Owning them buys nothing, and every op the
    # engine runs would re-enter Python (about 15 µs each, measured on an MLP step, most of it
    # the mode's own cost). Saved-tensor hooks stay pushed, so backward over a disposed
    # activation still raises. With the residency manager active the mode stays: operands
    # must be made resident.
    """
    data = thread_data()
    interceptor = data.interceptor
    if (
        interceptor is None
        or not data.pushed
        or data.suspended
        or data.backward_paused
        or interceptor.manager is not None
        or not _mode_on_top(interceptor)
    ):
        yield
        return
    torch._C._pop_torch_dispatch_stack(None)
    data.backward_paused = True
    try:
        yield
    finally:
        data.backward_paused = False
        torch._C._push_on_torch_dispatch_stack(interceptor)


def acquire(data: ThreadData) -> None:
    """A scope of this thread opened: make sure the mode and the saved hooks are pushed."""
    _install_global_hooks()
    if data.suspended:
        _resume(data)
    data.users += 1
    if not data.pushed:
        interceptor = data.interceptor
        if interceptor is None:
            interceptor = data.interceptor = Interceptor(data.counters)
        interceptor.__enter__()  # type: ignore[no-untyped-call]
        torch._C._autograd._push_saved_tensors_default_hooks(_saved.pack, _saved.unpack)
        data.pushed = True


def release(data: ThreadData) -> None:
    """A scope opened in ``data``'s thread closed; the last one pops the mode and hooks.

    Popping must happen on that thread (the mode stack is thread-local): a scope closed from
    another thread leaves the mode pushed but idle (no scope is current there, so it returns
    plain results) until that thread closes or opens a scope again.
    """
    on_thread = data.thread_id == threading.get_ident()
    if data.suspended and on_thread:
        _resume(data)
    if data.users > 0:
        data.users -= 1
    if data.users == 0 and data.pushed and on_thread:
        _pop(data)


def _pop(data: ThreadData) -> None:
    interceptor = data.interceptor
    if interceptor is None or not _mode_on_top(interceptor):
        return  # someone pushed a mode above ours and has not exited it yet: stay pushed
    torch._C._autograd._pop_saved_tensors_default_hooks()
    interceptor.__exit__(None, None, None)  # type: ignore[no-untyped-call]
    data.pushed = False


def _mode_on_top(mode: TorchDispatchMode) -> bool:
    depth = torch._C._len_torch_dispatch_stack()
    return depth > 0 and torch._C._get_dispatch_stack_at(depth - 1) is mode


def activate_residency(data: ThreadData, manager: ResidencyManager) -> None:
    """Intercept ops on this thread for the residency manager (until deactivated)."""
    acquire(data)
    assert data.interceptor is not None
    data.interceptor.manager = manager


def deactivate_residency(data: ThreadData) -> None:
    if data.interceptor is not None:
        data.interceptor.manager = None
    release(data)
