"""torch's global module and optimizer hooks, installed while any ``ts.record()`` is open.

They change nothing (each returns ``None``) and act only on a thread with an open recording:
- a module's forward pre-hook opens a *call* (its path in the model, the storages it was given),
  and notes its parameters (with their names), their gradients and its buffers; the forward
  hook (``always_call``: also when the forward raised) closes it with the storages it returned;
- an optimizer step's pre- and post-hooks note each parameter's gradient and optimizer state.

Every parameter and buffer of a model is noted when the model is first called, so they count
from op 0 even where no call reveals them (inside a compiled graph).

# NOTE [module paths]
# A call's path is its module's name in the model, as ``named_modules()`` gives it
# (``"transformer.h.3"``). The model is the first module called with no call open (a root: its
# own path is ""); every module under it is named at once, when the root is first called. A
# later root that contains an earlier one (the user called ``model.transformer`` directly
# first) renames what it contains; another root (a loss module) is named by its class, its
# modules below it (``"CrossEntropyLoss"``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

from tensorscope import _step_hooks
from tensorscope._modes import skip_in_dynamo
from tensorscope._sharded import dtensor_class, fsdp2_modules
from tensorscope._torch import graph_task_id
from tensorscope.plan.mode import recorder_here
from tensorscope.plan.recorder import Recorder, Watch

__all__ = ["install", "tensors_in", "uninstall"]

_handles: list[Any] = []
_users: list[int] = []  # one entry per open recording
_Tensor = torch.Tensor
_compiling = torch.compiler.is_compiling
_RESIZE: list[Any] = []  # UntypedStorage.resize_ as it was before install()
_DTENSOR: list[type | None] = [None]  # DTensor, once loaded: FSDP2's sharded parameters


def _resize(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` while a recording is open (NOTE [resized storages])."""
    before = storage.nbytes()
    out = _RESIZE[0](storage, size)
    rec = recorder_here()
    if rec is not None:
        rec.resized(storage, before)
    return out


def install() -> None:
    """Install the hooks (the first open recording does; callers hold record.py's lock)."""
    _users.append(1)
    _DTENSOR[0] = dtensor_class()
    if _handles:
        return
    module_hooks: Any = torch.nn.modules.module
    # torch copies its global forward hooks out of their dict before calling them (one step
    # under the GIL), so adding them here cannot fail another thread's forward; only a forward
    # that raised walks the dict while calling the always_call ones, a window left open.
    _handles.append(module_hooks.register_module_forward_pre_hook(_before_forward))
    _handles.append(module_hooks.register_module_forward_hook(_after_forward, always_call=True))
    # torch's optimizer hooks are not touched again once registered (see _step_hooks.py)
    _handles.append(_step_hooks.add_pre(_at_step, rank=0))
    _handles.append(_step_hooks.add_post(_at_step, rank=0))
    storage: Any = torch.UntypedStorage
    _RESIZE.append(storage.resize_)
    storage.resize_ = _resize


def uninstall() -> None:
    """Remove the hooks when the last open recording closes."""
    if _users:
        _users.pop()
    if _users:
        return
    while _handles:
        _handles.pop().remove()
    if _RESIZE:
        storage: Any = torch.UntypedStorage
        storage.resize_ = _RESIZE.pop()


def tensors_in(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a module's arguments or result (tuples, lists, dicts, HF ModelOutputs)."""
    if isinstance(value, _Tensor):
        yield value
    elif depth < 3:
        if isinstance(value, (tuple, list)):
            for item in value:
                yield from tensors_in(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                yield from tensors_in(item, depth + 1)


def _watched(rec: Recorder, value: Any) -> tuple[int, ...]:
    found: list[int] = []
    for tensor in tensors_in(value):
        w = rec.watch(tensor, -1)
        if w is not None and w.index not in found:
            found.append(w.index)
    return tuple(found)


def _name_tree(rec: Recorder, root: torch.nn.Module) -> None:
    """Name ``root`` and every module under it (see the NOTE on module paths)."""
    key = id(root)
    names = rec.call_keys
    tree = dict(root.named_modules(remove_duplicate=False))
    ids = {id(module) for module in tree.values()}
    contained = [r for r in rec.roots if r in ids]
    if rec.roots and not contained:
        prefix = type(root).__name__
        taken = set(names.values())
        base, count = prefix, 1
        while prefix in taken:
            count += 1
            prefix = f"{base}#{count}"
    else:
        prefix = ""
    rec.roots = [r for r in rec.roots if r not in ids]
    rec.roots.append(key)
    if fsdp2_modules(root):  # NOTE [what FSDP2 holds] (_sharded.py): classified at close
        rec.sharded_roots.append(weakref.ref(root))
    for name, module in tree.items():
        name = _without_compile_wrapper(name)
        path = f"{prefix}.{name}" if prefix and name else prefix or name
        if contained or id(module) not in names:
            names[id(module)] = path
    # Every parameter and buffer of the model, also those its calls do not reveal (a compiled
    # graph runs its modules unseen).
    for module in tree.values():
        path = names.get(id(module), "")
        _note_state(rec, module, f"{path}." if path else "")


def _note_state(rec: Recorder, module: torch.nn.Module, prefix: str) -> None:
    for name, param in module._parameters.items():
        if param is not None:
            _note_parameter(rec, param, prefix + name)
    for name, buffer in module._buffers.items():
        if buffer is not None:
            rec.mark(buffer, "buffer", None, prefix + name)


def _without_compile_wrapper(name: str) -> str:
    """``torch.compile(module)`` wraps it as ``_orig_mod``: paths are the model's own.

    Example:
        >>> _without_compile_wrapper("_orig_mod.transformer.h.0._orig_mod.attn")
        'transformer.h.0.attn'
    """
    parts = [part for part in name.split(".") if part != "_orig_mod"]
    return ".".join(parts)


def _path(rec: Recorder, module: torch.nn.Module) -> str:
    path = rec.call_keys.get(id(module))
    if path is not None:
        return path
    if not rec.stack:
        _name_tree(rec, module)
        return rec.call_keys[id(module)]
    parent = rec.calls[rec.stack[-1]].path
    path = f"{parent}.{type(module).__name__}" if parent else type(module).__name__
    rec.call_keys[id(module)] = path
    return path


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    if _compiling():  # inside a compiled graph: it counts as its outputs
        return
    rec = recorder_here()
    if rec is None:
        return
    path = _path(rec, module)
    rec.enter_call(path, _watched(rec, args), graph_task_id() != -1)
    rec.module_calls.setdefault(id(module), []).append(rec.stack[-1])
    _note_state(rec, module, f"{path}." if path else "")


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    if _compiling():  # inside a compiled graph: it counts as its outputs
        return
    rec = recorder_here()
    if rec is None:
        return
    open_calls = rec.module_calls.get(id(module))
    if not open_calls:
        return
    rec.exit_call(open_calls.pop(), _watched(rec, output))


def _note_parameter(rec: Recorder, param: torch.Tensor, name: str = "") -> Watch | None:
    w = rec.watch(param, -1)
    if w is None:
        return None
    sharded = _DTENSOR[0] is not None and isinstance(param, _DTENSOR[0])
    rec.mark(param, "sharded_parameter" if sharded else "parameter", None)
    if w.index not in rec.param_seen:
        rec.param_seen.add(w.index)
        rec.params.append(weakref.ref(param))
    if name and not w.name:
        w.name = name
    grad = param.grad
    if grad is not None:
        rec.mark(grad, "gradient", w, w.name)
    return w


def _at_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before and after each optimizer step: its parameters' gradients and state."""
    rec = recorder_here()
    if rec is None:
        return
    state = optimizer.state
    for group in optimizer.param_groups:
        for param in group["params"]:
            w = _note_parameter(rec, param)
            values = state.get(param)
            if not values:
                continue
            for value in values.values():
                if isinstance(value, _Tensor):
                    rec.mark(value, "optimizer_state", w, w.name if w is not None else "")


skip_in_dynamo(
    _resize,
    _before_forward,
    _after_forward,
    _at_step,
    _note_parameter,
    _note_state,
    _path,
    _name_tree,
)
