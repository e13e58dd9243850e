"""Splitting multi-tensor ops (``_foreach_*``, ``_fused_*``, ``_amp_foreach_*``, and
``torch.cat`` into an unmanaged result) into groups that fit the budget.

``clip_grad_norm_``, ``AdamW(foreach=True)`` and ``AdamW(fused=True)`` hand one op every
parameter at once; under a budget smaller than the parameters that op could never run. Each
index of their tensor lists is independent of the others, so the manager runs the op on
consecutive index ranges whose operands and results fit, and joins the results: the numbers
are exactly those of one call.

# NOTE [flattening for communication]
# ``DistributedDataParallel`` broadcasts every parameter at construction, and its buffers
# before each forward, by flattening them into one tensor per bucket (250 MiB): ``torch.cat``
# of all of them. Outside a scope that result is the communication buffer, not a managed
# tensor: only the operands must be resident, each only while it is copied. So the result is
# made whole, and its operands are concatenated in groups that fit and copied into place
# (``cat_in_pieces``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tensorscope._optable import op_info
from tensorscope._torch import no_dispatch

__all__ = [
    "cat_arguments",
    "cat_in_pieces",
    "index_count",
    "is_multi_tensor",
    "join_results",
    "plan_chunks",
    "slice_call",
]


def _list_positions(func: Any) -> tuple[int, ...] | None:
    """Positions of the per-index list arguments of a multi-tensor op (None: not one)."""
    return op_info(func).lists


def is_multi_tensor(func: Any) -> bool:
    return _list_positions(func) is not None


def _length(value: Any) -> int:
    return int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)


def _normalized(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    names = [argument.name for argument in func._schema.arguments]
    values = list(args)
    for name in names[len(values) :]:
        if name not in kwargs:
            break
        values.append(kwargs[name])
    return values


def index_count(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The common length of a multi-tensor op's lists (0 if they disagree or it is not one)."""
    positions = _list_positions(func)
    if positions is None:
        return 0
    values = _normalized(func, args, kwargs)
    lengths = {_length(values[p]) for p in positions if p < len(values)} - {0}
    return lengths.pop() if len(lengths) == 1 else 0


def plan_chunks(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    index_bytes: Callable[[int], int],
    fixed_bytes: int,
    budget: int,
) -> list[range] | None:
    """Consecutive index ranges whose bytes (``index_bytes(i)`` each plus ``fixed_bytes``) fit
    ``budget``; None if the op is not a multi-tensor op or one index alone does not fit."""
    count = index_count(func, args, kwargs)
    if count == 0:
        return None
    chunks: list[range] = []
    start, total = 0, fixed_bytes
    for index in range(count):
        nbytes = index_bytes(index)
        if fixed_bytes + nbytes > budget:
            return None
        if total + nbytes > budget:
            chunks.append(range(start, index))
            start, total = index, fixed_bytes
        total += nbytes
    chunks.append(range(start, count))
    return chunks


def slice_call(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], chunk: range
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of ``func`` restricted to the indices in ``chunk``."""
    positions = _list_positions(func) or ()
    values = _normalized(func, args, kwargs)
    names = [argument.name for argument in func._schema.arguments]
    sliced = list(values)
    for position in positions:
        if position < len(values) and _length(values[position]):
            sliced[position] = values[position][chunk.start : chunk.stop]
    new_args = tuple(sliced[: len(args)])
    new_kwargs = dict(kwargs)
    for position in range(len(args), len(sliced)):
        new_kwargs[names[position]] = sliced[position]
    return new_args, new_kwargs


def join_results(parts: Sequence[Any]) -> Any:
    """One op's result from its chunks' results (None, a list, or a tuple of lists)."""
    first = parts[0] if parts else None
    if first is None:
        return first
    if isinstance(first, list):
        return [item for part in parts for item in part]
    if isinstance(first, tuple):
        return tuple(join_results([part[i] for part in parts]) for i in range(len(first)))
    return first


def cat_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[torch.Tensor], int]:
    """The tensors and the dimension of a ``torch.cat`` call."""
    tensors = list(kwargs.get("tensors", args[0] if args else []))
    dim = int(kwargs.get("dim", args[1] if len(args) > 1 else 0))
    return tensors, dim


def cat_in_pieces(
    tensors: list[torch.Tensor],
    dim: int,
    sizes: list[int],
    budget: int,
    meta: torch.Tensor,
    run: Callable[[list[torch.Tensor]], torch.Tensor],
) -> torch.Tensor:
    """``torch.cat(tensors, dim)`` as consecutive groups whose managed bytes (``sizes``) fit
    ``budget``, each run by ``run`` and copied into a result shaped like ``meta`` (see the
    NOTE)."""
    groups: list[list[torch.Tensor]] = [[]]
    total = 0
    for tensor, nbytes in zip(tensors, sizes, strict=True):
        if groups[-1] and total + nbytes > budget:
            groups.append([])
            total = 0
        groups[-1].append(tensor)
        total += nbytes
    with no_dispatch():
        out = torch.empty(meta.shape, dtype=meta.dtype, device=tensors[0].device)
    offset = 0
    for group in groups:
        part = run(group)
        if part.numel() == 0:
            continue
        length = part.shape[dim]
        with no_dispatch():
            out.narrow(dim, offset, length).copy_(part)
        offset += length
    return out
