"""The interceptor: one TorchDispatchMode per thread that sees every op while it is needed.

# NOTE [why a dispatch mode]
# Only a TorchDispatchMode sees every tensor a step creates: factories, module internals, the
# ops autograd runs in backward and those of optimizer steps (DESIGN.md, measured). It is pushed
# when the first scope of a thread opens (or ``ts.manage()`` runs there) and popped when the last
# user goes (asyncio tasks of one thread share it; each reads its own current scope from a
# contextvar), so with no scope open torch runs untouched.
#
# NOTE [hot path]
# Every op pays for this handler, so it does the least it can: one dict lookup classifies the op
# (cached per OpOverload from its schema), ``func._op`` skips OpOverload's Python ``__call__``,
# and each fresh result gets a class switch and a RefState, nothing else. ``_should_skip_dynamo``
# returns False so torch does not wrap ``__torch_dispatch__`` in a dynamo-disabling shim (that
# shim imports torch._dynamo and costs ~1 µs per op); dynamo is told to skip our code objects
# instead (``_skip_our_frames_in_dynamo``).
#
# NOTE [what is never owned]
# See _thread.py's table for the order of the rules. Parameters and buffers are converted back
# to plain classes when created (ref.py); a leaf's ``.grad`` is recognised while autograd's
# AccumulateGrad node runs (detach when it steals the incoming gradient, clone/empty_strided
# when it copies, add when it accumulates out of place) and is owned by the leaf's scope, or by
# nobody for parameters; optimizer steps run inside the record_function "Optimizer.step#..."
# and nothing created there is owned (their state is born there); autocast's cached casts of
# parameters live in autocast's cache until the autocast region exits; a result that *is* one
# of the op's inputs (a no-op ``.to()`` under inference mode) is never taken; and results made
# under the state makers of _sites.py are left plain.
"""

from __future__ import annotations

import functools
from types import CodeType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tensorscope import _compiled, _keepers, _optimizer
from tensorscope._engine import FAST
from tensorscope._sites import NOT_OWNED, Site, capture_site, site_verdicts, user_site
from tensorscope._slot import ACTIVE
from tensorscope._state import STATES, Counters, Owner, RefState, on_ref_death, register_ref
from tensorscope._thread import CURRENT_SCOPE, ThreadState, owning_scope, thread_state
from tensorscope._torch import (
    ACCUMULATE_GRAD,
    ORIGINAL_FROMBUFFER,
    current_autograd_node,
    graph_task_id,
    tracing,
    treat_as_plain_for_tracing,
)
from tensorscope.ref import (
    TensorRef,
    grad_owner_for,
    mark_grad_of,
    release_pending,
    unown_buffer,
)

__all__ = [
    "MUTATING",
    "Interceptor",
    "accumulate_grad_leaf",
    "acquire",
    "adopt_result",
    "release",
    "settle",
]

_Tensor = torch.Tensor
PLAIN, MUTATING, GRAD_CANDIDATE, CAST, FRESH, RECORD_ENTER, RECORD_EXIT = 0, 1, 2, 3, 4, 5, 6
_KINDS: dict[Any, int] = {}
_GRAD_MAKERS = {
    "aten::detach",
    "aten::clone",
    "aten::add",
    "aten::empty_strided",
    "aten::new_empty_strided",
}


def _classify(func: Any) -> int:
    schema = func._schema
    kind = PLAIN
    if any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        kind = MUTATING
    elif schema.name in _GRAD_MAKERS:
        kind = GRAD_CANDIDATE
    elif schema.name == "aten::_to_copy":
        kind = CAST
    elif schema.name == "aten::lift_fresh":  # torch.tensor(data): its input is its own result
        kind = FRESH
    elif schema.name == "profiler::_record_function_enter_new":
        kind = RECORD_ENTER
    elif schema.name == "profiler::_record_function_exit":
        kind = RECORD_EXIT
    _KINDS[func] = kind
    return kind


def accumulate_grad_leaf() -> torch.Tensor | None:
    """The leaf whose ``.grad`` autograd is making right now, if an AccumulateGrad node runs."""
    if graph_task_id() == -1:
        return None
    node = current_autograd_node()
    if type(node) is not ACCUMULATE_GRAD:
        return None
    leaf: torch.Tensor = node.variable  # type: ignore[attr-defined]
    return leaf


def adopt(
    tensor: torch.Tensor,
    owner: Owner,
    counters: Counters,
    _capture: Any = capture_site,
    _not_owned: Any = NOT_OWNED,
    _tracing: Any = tracing,
) -> bool:
    """Make a fresh op result a ref owned by ``owner``; False when a state maker made it, or
    ``torch.jit.trace`` is recording (see _thread.py's NOTE on TorchScript)."""
    site = _capture(2)
    if site is _not_owned or _tracing():
        return False
    adopt_at(tensor, owner, counters, site)
    return True


def adopt_at(
    tensor: torch.Tensor,
    owner: Owner,
    counters: Counters,
    site: Site,
    _new: Any = RefState,
    _on_death: Any = on_ref_death,
    _states: dict[int, RefState] = STATES,
) -> None:
    """Make a fresh op result made at ``site`` a ref owned by ``owner``.

    The hot path: ``register_ref`` inlined (default arguments bind the globals)."""
    tensor.__class__ = TensorRef
    state = _new(tensor, _on_death)
    key = id(tensor)
    state.key = key
    state.owner = owner
    state.site = site
    state.counters = counters
    state.disposal = None
    state.grad_of = None
    _states[key] = state
    owner._owned[key] = state
    counters.created_in_scope += 1


def _is_input(out: object, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    for arg in args:
        if arg is out:
            return True
        if type(arg) is list or type(arg) is tuple:
            for item in arg:
                if item is out:
                    return True
    if kwargs:
        for arg in kwargs.values():
            if arg is out:
                return True
    return False


def _cached_by_autocast(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
    """Whether autocast keeps this cast in its weight cache (torch's ``cached_cast`` rule: a
    float32 leaf that requires grad, cast to the autocast dtype, with the cache on, inside an
    autocast region). Inside autocast's own kernel its key is excluded, so the region is told
    by autocast's (thread-local) nesting count, probed with an increment and a decrement."""
    source = args[0] if args else None
    if not isinstance(source, _Tensor) or not (source.is_leaf and source.requires_grad):
        return False
    if source.dtype is not torch.float32 or source._is_view():
        return False
    dtype = kwargs.get("dtype") if kwargs else None
    if dtype is None or dtype != torch.get_autocast_dtype(source.device.type):
        return False
    if not torch.is_autocast_cache_enabled():
        return False
    nesting = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return nesting > 1


class Interceptor(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Makes op results refs of the current scope; one instance per thread."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile then compiles user code with this mode on the stack (off while it
        # compiles, on while the compiled code runs: its results are owned like any other).
        return True

    def __init__(self, state: ThreadState) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.state = state
        self.counters = state.counters
        # With the C++ engine this mode only serves the residency manager.
        self.owns_results = FAST is None

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
        kind = _KINDS.get(func)
        if kind is None:
            kind = _classify(func)
        if ACTIVE:
            # Results of ops on managed tensors are managed inside scopes and optimizer steps.
            due = state.unowned_depth > 0 or self._scope() is not None
            out = ACTIVE[0].run_op(func, kind, args, kwargs, due)
        else:
            out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        if kind >= RECORD_ENTER:
            if kind == RECORD_ENTER:
                optimizer = isinstance(args[0], str) and args[0].startswith("Optimizer.")
                state.regions.append(optimizer)
                state.unowned_depth += optimizer
                return out
            if kind == RECORD_EXIT:
                if state.regions and state.regions.pop():
                    state.unowned_depth -= 1
                return out
        if not self.owns_results:
            return out
        if kind:
            if kind == MUTATING:
                return out
            if kind == GRAD_CANDIDATE:
                if graph_task_id() != -1 and self._adopted_as_grad(out):
                    return out
            elif kind == CAST:
                if _cached_by_autocast(args, kwargs):
                    return out
            else:  # FRESH
                scope = self._scope()
                if scope is not None and type(out) is _Tensor:
                    adopt(out, scope, self.counters)
                return out
        if state.unowned_depth:
            return out
        scope = CURRENT_SCOPE.get()
        if scope is None:
            return out
        if scope._closed:
            scope = scope.resolve()
            if scope is None:
                return out
        kind_out = type(out)
        if kind_out is _Tensor:
            if not _is_input(out, args, kwargs):
                adopt(out, scope, self.counters)
        elif kind_out is tuple or kind_out is list:
            for item in out:
                if type(item) is _Tensor and not _is_input(item, args, kwargs):
                    adopt(item, scope, self.counters)
        return out

    def _scope(self) -> Owner | None:
        if self.state.unowned_depth:
            return None
        scope = CURRENT_SCOPE.get()
        return scope.resolve() if scope is not None else None

    def _adopted_as_grad(self, out: Any) -> bool:
        """True when ``out`` is a ``.grad`` in the making (then it was handled here)."""
        leaf = accumulate_grad_leaf()
        if leaf is None or type(out) is not _Tensor:
            return False
        owner = grad_owner_for(leaf)
        if owner is not None:
            out.__class__ = TensorRef
            state = register_ref(out, owner, user_site(2), self.counters)
            mark_grad_of(state, leaf)
        return True  # else: the gradient of a parameter or unowned tensor stays plain


def adopt_result(
    tensor: torch.Tensor,
    code: CodeType | None,
    lasti: int,
    _state: Any = thread_state,
    _current: Any = CURRENT_SCOPE.get,
    _task: Any = graph_task_id,
) -> None:
    """The C++ engine's hook: a fresh plain result of a top-level op on a thread with a scope
    open (csrc/fast.cpp), with the site of the user frame that called the op (``code`` None:
    no user frame; ``lasti`` -1: a state maker called it). The same rules as the Python mode
    (see _thread.py's table)."""
    state = _state()
    if state.pending:
        release_pending(state)
    scope = _current()
    if scope is None:
        return
    if scope._closed:
        scope = scope.resolve()
        if scope is None:
            return
    site: Site = None if code is None else (code, lasti)
    if _task() != -1:  # inside autograd's engine: a .grad goes to its leaf's owner, or nobody
        leaf = accumulate_grad_leaf()
        if leaf is not None:
            owner = grad_owner_for(leaf)
            if owner is not None:
                tensor.__class__ = TensorRef
                if lasti < 0:  # a grad is owned whoever called backward: the user frame
                    site = user_site(1)
                mark_grad_of(register_ref(tensor, owner, site, state.counters), leaf)
            return
    if lasti >= 0:
        adopt_at(tensor, scope, state.counters, site)


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
    _skip_our_frames_in_dynamo()
    treat_as_plain_for_tracing(TensorRef)
    if FAST is not None:
        # The engine does adopt_at's work itself in the common case (csrc/fast.cpp).
        adoption = (TensorRef, RefState, Counters, on_ref_death, STATES, CURRENT_SCOPE)
        FAST.set_hook(adopt_result, *site_verdicts(), adoption)


def _skip_our_frames_in_dynamo() -> None:
    """Tell torch.compile never to trace tensorscope's per-op frames (they are not user code):
    dynamo's C frame callback then skips them at no cost (what ``torch._dynamo.skip_code``
    does, without importing torch._dynamo)."""
    try:
        frames: Any = torch._C._dynamo.eval_frame
        skip = frames._FrameExecStrategy(frames._FrameAction.SKIP, frames._FrameAction.DEFAULT)
    except AttributeError:  # pragma: no cover - an older or newer torch
        return
    for function in (
        Interceptor.__torch_dispatch__,
        Interceptor._scope,
        Interceptor._adopted_as_grad,
        adopt,
        _is_input,
        _cached_by_autocast,
        accumulate_grad_leaf,
        capture_site,
        register_ref,
        release_pending,
        adopt_result,
        adopt_at,
    ):
        frames.set_code_exec_strategy(function.__code__, skip)


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
    if state.pending:
        release_pending(state)
    state.resume()  # an optimizer step that raised left it popped
    if residency:
        state.residency_users += 1
    else:
        state.scope_users += 1
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
    else:
        state.scope_users = max(0, state.scope_users - 1)
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
