"""The tensors reachable from a value a user hands on: what a scoped function returns or
yields, what is put on a multiprocessing queue.

# NOTE [how far the walk goes]
# Containers (tuples, lists, sets, dicts, HF ``ModelOutput``s, which are dicts), dataclass fields
# and the attributes of plain objects (an HF ``DynamicCache`` holds its layers in a list, each
# layer its ``keys`` and ``values``) are walked, each object once, up to a depth of 6 and 100 000
# objects: enough for a model's output with its cache, bounded for anything else. Modules,
# optimizers, classes, functions and modules of code are never entered: they are not data a
# result carries, and walking a model would find its parameters (never owned anyway).

Layer 6: imports only torch.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["objects_in", "tensors_in"]

MAX_DEPTH = 6
MAX_OBJECTS = 100_000
_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
_OPAQUE = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    torch.nn.Module,
    torch.optim.Optimizer,
    torch.dtype,
    torch.device,
)


def tensors_in(value: Any, *, through_callables: bool = False) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``value`` (see the NOTE above), each object visited once.

    ``through_callables``: also the arguments bound in ``functools.partial`` objects and the
    cells of closures (what a function will read when it is called again: a checkpoint's
    recomputation).

    Example:
        >>> import torch
        >>> from tensorscope._reach import tensors_in
        >>> len(list(tensors_in({"a": torch.ones(1), "b": [torch.zeros(2), 3]})))
        2
    """
    for item in objects_in(value, through_callables=through_callables):
        if isinstance(item, torch.Tensor):
            yield item


def objects_in(value: Any, *, through_callables: bool = False) -> Iterator[Any]:
    """Every object the walk of ``tensors_in`` visits (containers, objects and tensors, not
    atoms such as numbers and strings), each once, ``value`` included."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and len(seen) < MAX_OBJECTS:
        item, depth = stack.pop()
        if isinstance(item, _ATOMS) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, torch.Tensor) or depth >= MAX_DEPTH:
            continue
        children = _bound(item) if through_callables else None
        if children is None:
            children = _children(item)
        if children is not None:
            stack.extend((child, depth + 1) for child in reversed(children))


def _bound(item: Any) -> list[Any] | None:
    """What a callable carries to its next call: a partial's arguments, a closure's cells."""
    if isinstance(item, functools.partial):
        return [item.func, *item.args, *item.keywords.values()]
    if isinstance(item, types.MethodType):
        return [item.__func__]
    if isinstance(item, types.FunctionType):
        return [cell.cell_contents for cell in item.__closure__ or () if _filled(cell)]
    return None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _children(item: Any) -> list[Any] | None:
    if isinstance(item, dict):
        return list(item.values())
    if isinstance(item, (list, tuple, set, frozenset)):
        return list(item)
    if isinstance(item, _OPAQUE):
        return None
    if dataclasses.is_dataclass(item):
        return [getattr(item, field.name, None) for field in dataclasses.fields(item)]
    attributes = getattr(item, "__dict__", None)
    return list(attributes.values()) if isinstance(attributes, dict) else None
