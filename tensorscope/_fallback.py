"""The scope key's kernels: the pure-Python engine (a boxed fallback on the DeferredInit key),
and the fallthroughs both engines share.

Used where the C++ engine (csrc/fast.cpp) could not be built, or with
``TENSORSCOPE_ENGINE=python``. It sits on the same dispatch key as the C++ engine and applies
the same rules (_adopt.py's NOTE), so both engines see the same ops and own the same tensors;
it only costs more per op (docs/design.md §9).

# NOTE [the Python engine, step by step]
# While a scope is open on a thread, the key is in its included set (_thread.py). Each op the
# thread calls first reaches ``_run``, which runs the op below the key with the key excluded
# (so the ops it runs inside are not seen: only top-level ops are), then picks its fresh
# results — plain tensors that are not among its inputs (``lift_fresh`` returns its own new
# input) and not functorch wrappers — and hands them, with the creation site, to
# ``adopt_fresh``. Nothing is owned while ``torch.jit.trace`` records (its tensors become the
# trace's constants). ``detach`` and ``alias`` fall through (see _adopt.py's NOTE).
#
# NOTE [why one kernel per op, not only a fallback]
# A Python fallback alone (``Library.fallback``) would do, but torch 2.13 cannot run one while a
# TorchDispatchMode is active (the residency manager's, FakeTensorMode) or an argument is a
# Python tensor subclass (a jagged nested tensor, DTensor): it then looks for the op's own
# Python kernel on that key and fails an internal assert when there is none. So the Python
# engine registers a kernel on the key for every op that exists when the first scope opens
# (about 3600; ~0.5 s, once per process), and keeps the fallback for ops defined later, which
# get their own kernel at the next scope entry (``register_new_ops``).

Layer 10: imports only layers 0-9.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorscope._adopt import adopt_fresh
from tensorscope._optable import BARE_ALIAS, FRESH_INPUT, NAMED, TABLE, op_info
from tensorscope._sites import capture_site
from tensorscope._torch import SCOPE_KEY, tracing

__all__ = ["install"]

_C: Any = torch._C
_Tensor = torch.Tensor
_KEY_ALONE = _C.DispatchKeySet(SCOPE_KEY)
_exclude = _C._ExcludeDispatchKeyGuard
_functorch_depth = _C._functorch.get_dynamic_layer_stack_depth
_functorch_wrapped = _C._functorch.is_functorch_wrapped_tensor
_functional: Any = torch._is_functional_tensor
_library: list[Any] = []


def _is_input(out: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
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


def _fresh(out: object, args: tuple[Any, ...], kwargs: dict[str, Any], op: Any) -> list[Any]:
    """The op's results that are new plain tensors (not inputs, not wrappers)."""
    if type(out) is _Tensor:
        outputs: list[Any] = [out]
    elif type(out) is tuple or type(out) is list:
        outputs = []
        for item in out:  # one object returned twice is adopted once
            if type(item) is _Tensor and not any(item is seen for seen in outputs):
                outputs.append(item)
    else:
        return []
    # torch.tensor(data) hands its own new tensor to lift_fresh, which returns it
    if outputs and not (TABLE.get(id(op)) or op_info(op)).flags & FRESH_INPUT:
        outputs = [t for t in outputs if not _is_input(t, args, kwargs)]
    if outputs and _functorch_depth() > 0:
        outputs = [t for t in outputs if not (_functorch_wrapped(t) or _functional(t))]
    return outputs


def _run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    with _exclude(_KEY_ALONE):  # below the key; the ops this one runs inside are not top-level
        out = op._op(*args, **kwargs) if kwargs else op._op(*args)
    fresh = _fresh(out, args, kwargs, op)
    if fresh and not tracing():
        adopt_fresh(fresh, capture_site(2))
    return out


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The key's fallback, for ops defined after the per-op kernels were registered."""
    _unregistered.add(op)
    return _run(op, args, kwargs)


def _kernel_for(name: str) -> Any:
    """The key's kernel for the op named ``name`` ("aten::add.Tensor")."""
    resolved: list[Any] = []

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not resolved:
            namespace, _, rest = name.partition("::")
            packet, _, overload = rest.partition(".")
            packet_ops = getattr(getattr(torch.ops, namespace), packet)
            resolved.append(getattr(packet_ops, overload or "default"))
        return _run(resolved[0], args, kwargs)

    return kernel


# detach and alias (the op table's bare aliases: _adopt.py's NOTE)
_FALLTHROUGH = frozenset(name for name, flags in NAMED.items() if flags & BARE_ALIAS)
_unregistered: set[Any] = set()
_libraries: dict[str, Any] = {}


def _register(names: Any) -> None:
    library: Any = torch.library.Library
    for name in names:
        if name in _FALLTHROUGH:
            continue
        namespace, _, rest = name.partition("::")
        lib = _libraries.get(namespace)
        if lib is None:
            lib = _libraries[namespace] = library(namespace, "IMPL")
        lib.impl(rest, _kernel_for(name), "DeferredInit")


def install(python_engine: bool) -> None:
    """Register the key's kernels (idempotent): ``detach`` and ``alias`` fall through it in both
    engines (_adopt.py's NOTE); the Python engine where the C++ one is not loaded (see the NOTE
    above on why one kernel per op)."""
    if _library:
        return
    library: Any = torch.library.Library
    aten = library("aten", "IMPL")
    for name in _FALLTHROUGH:
        aten.impl(name.removeprefix("aten::"), torch.library.fallthrough_kernel, "DeferredInit")
    _library.append(aten)
    if python_engine:
        every_op = library("_", "IMPL")
        every_op.fallback(_fallback, "DeferredInit")
        _library.append(every_op)
        _register(_C._dispatch_get_all_op_names())


def register_new_ops() -> None:
    """Give ops first seen by the fallback a kernel of their own (at a scope's entry: never
    while an op runs)."""
    if _unregistered:
        names = {f"{op._schema.name}.{op._overloadname}" for op in _unregistered}
        _unregistered.clear()
        _register(name.removesuffix(".default") for name in names)
