"""Results of ``torch.compile``d code are owned by the current scope, as eager results are.

# NOTE [compiled outputs]
# Inductor's generated code allocates its buffers with C++ helpers that never reach torch's
# dispatcher, so neither the dispatch mode nor the C++ engine sees them: inside a scope a compiled
# function returned plain tensors that nobody owned. Every graph dynamo compiles goes through
# ``OutputGraph.call_user_compiler``; the callable it returns is what the compiled frame calls at
# run time. That method is wrapped so the callable is wrapped too: after each call, with a scope
# open on the thread, its plain tensor outputs that are not its inputs become refs of that scope
# (the rules of _thread.py's table; the site is the user frame that called the compiled code).
# Backends whose graphs run through the dispatcher (``eager``: a GraphModule's forward) own their
# results already and are left alone. Dynamo is imported lazily by torch, so if it is not loaded
# yet when tensorscope is imported, a meta-path finder applies the wrapper right after
# ``torch._dynamo.output_graph`` executes; graphs compiled before ``import tensorscope`` stay
# unwrapped (docs/scopes.md). Compiled backward graphs need nothing: autograd hands their
# gradients to ``.grad`` through dispatched ops (AccumulateGrad), which are owned as usual.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

import torch

from tensorscope._sites import caller_site
from tensorscope._state import register_ref
from tensorscope._thread import CURRENT_SCOPE, owning_scope, thread_state
from tensorscope._torch import tracing
from tensorscope.ref import TensorRef

__all__ = ["OBSERVERS", "install", "owning_outputs"]

_OUTPUT_GRAPH = "torch._dynamo.output_graph"
_Tensor = torch.Tensor
_lock = threading.Lock()
_patched: list[bool] = []
# Told about every call of compiled code while non-empty (``ts.record()``'s recorder):
# ``observer.enter()`` before, ``observer.exit(out, args)`` after (also when the call raised,
# with ``out`` None). Empty otherwise, at the cost of one list test per call.
OBSERVERS: list[Any] = []


def owning_outputs(compiled_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a backend's compiled callable so its fresh plain outputs are owned in scopes."""

    def run_compiled(*args: Any, **kwargs: Any) -> Any:
        if OBSERVERS:
            return _observed(compiled_fn, args, kwargs)
        out = compiled_fn(*args, **kwargs)
        if CURRENT_SCOPE.get() is not None:
            _own(out, args)
        return out

    run_compiled.__name__ = getattr(compiled_fn, "__name__", "compiled_fn")
    run_compiled.__qualname__ = run_compiled.__name__
    run_compiled.__wrapped__ = compiled_fn  # type: ignore[attr-defined]
    return run_compiled


def _observed(compiled_fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    observers = list(OBSERVERS)
    for observer in observers:
        observer.enter()
    out = None
    try:
        out = compiled_fn(*args, **kwargs)
        if CURRENT_SCOPE.get() is not None:
            _own(out, args)
    finally:
        for observer in reversed(observers):
            observer.exit(out, args)
    return out


def _own(out: Any, args: Sequence[Any]) -> None:
    outputs = out if type(out) is tuple or type(out) is list else (out,)
    fresh = [item for item in outputs if type(item) is _Tensor]
    if not fresh:
        return
    state = thread_state()
    scope = owning_scope(state)
    if scope is None or tracing():
        return
    inputs = {id(arg) for arg in args}
    site = caller_site(2)
    for tensor in fresh:
        if id(tensor) in inputs:  # returned unchanged: not this call's result
            continue
        inputs.add(id(tensor))  # one output object listed twice is adopted once
        tensor.__class__ = TensorRef
        register_ref(tensor, scope, site, state.counters)


def _runs_through_dispatcher(compiled_fn: Any) -> bool:
    """The ``eager`` backend hands back a GraphModule's forward: its ops are dispatched."""
    target = getattr(compiled_fn, "__self__", compiled_fn)
    return isinstance(target, torch.fx.GraphModule)


def _patch(output_graph: ModuleType) -> None:
    with _lock:
        if _patched:
            return
        cls: Any = getattr(output_graph, "OutputGraph", None)
        original = getattr(cls, "call_user_compiler", None)
        if original is None:  # pragma: no cover - a torch without this seam (pinned: has it)
            return
        _patched.append(True)

    def call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
        compiled_fn = original(self, gm, example_inputs)
        if _runs_through_dispatcher(compiled_fn):
            return compiled_fn
        return owning_outputs(compiled_fn)

    call_user_compiler.__wrapped__ = original  # type: ignore[attr-defined]
    cls.call_user_compiler = call_user_compiler


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when dynamo's output_graph is about to load, it has the real
    finders locate it and wraps the loader so the patch follows the module's execution."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _OUTPUT_GRAPH:
            return None
        _remove_finder()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:  # pragma: no cover - torch without dynamo
            return None
        loader: Any = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


_finder = _PatchOnImport()


def _remove_finder() -> None:
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_finder)


def install() -> None:
    """Patch dynamo now if it is loaded, else as soon as it is (idempotent)."""
    module = sys.modules.get(_OUTPUT_GRAPH)
    if module is not None and hasattr(module, "OutputGraph"):
        _remove_finder()
        _patch(module)
    elif not _patched and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
