"""Find a model's block chain: the longest ``nn.ModuleList`` of blocks of one class.

:func:`pick_chain` is the rule, on plain data (no torch import, tested without tensors);
:func:`find_chain` applies it to a model's ``named_modules()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from tensorscope.errors import ArgumentTypeError, InvalidArgumentError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["find_chain", "pick_chain"]

_PREFIX = "tensorscope.checkpoint:"

# NOTE [which list is the chain]
# HF models keep their blocks in one nn.ModuleList called in a Python loop (model.layers,
# transformer.h, encoder.layer, T5's block), each block fed the previous one's hidden state.
# A candidate is a ModuleList of at least two entries of one class. Candidates inside an entry
# of another candidate are left out: a mixture-of-experts layer's `experts` list (8 experts in
# each of 2 layers of a tiny config) is called side by side, not in a chain, and a block's
# internal list is the block's business. Of the rest, the longest wins; two of the same length
# (an encoder and a decoder, CLIP's text and vision towers) are ambiguous: the error names them
# and the caller picks one with `blocks=`.


def pick_chain(lists: Sequence[tuple[str, Sequence[str]]]) -> str:
    """The path of the block chain among a model's module lists (NOTE [which list is the chain]).

    Args:
        lists: every ``nn.ModuleList`` of the model, in module order, as ``(dotted path, class
            names of its entries)``; the root model's own path is ``""``.

    Returns:
        The dotted path of the chosen list.

    Raises:
        InvalidArgumentError: no list of two or more blocks of one class, or two such lists of
            the same, greatest length.

    Example:
        >>> pick_chain([("model.layers", ["LlamaDecoderLayer"] * 4),
        ...             ("model.layers.0.mlp.experts", ["Expert"] * 8)])
        'model.layers'
        >>> pick_chain([("transformer.h", ["GPT2Block"] * 12), ("heads", ["Linear", "Conv1d"])])
        'transformer.h'
    """
    chains = [
        (path, len(kinds))
        for path, kinds in lists
        if len(kinds) >= 2 and all(kind == kinds[0] for kind in kinds)
    ]
    outer = [
        (path, n)
        for path, n in chains
        if not any(_inside_entry(path, other) for other, _ in chains if other != path)
    ]
    if not outer:
        seen = ", ".join(f"{path or '<model>'} ({len(kinds)})" for path, kinds in lists) or "none"
        raise InvalidArgumentError(
            f"{_PREFIX} the model has no block chain: no nn.ModuleList holds two or more blocks "
            f"of one class (module lists found: {seen}). Pass the chain itself "
            f"(checkpoint_chain(model.blocks, ...)), or name it with blocks='path.to.list'; "
            f"for an nn.Sequential of one-tensor layers use Checkpointable."
        )
    longest = max(n for _, n in outer)
    best = [path for path, n in outer if n == longest]
    if len(best) > 1:
        raise InvalidArgumentError(
            f"{_PREFIX} the model has {len(best)} block chains of {longest} blocks: "
            f"{', '.join(best)}. Choose one with blocks='{best[0]}' (one chain is checkpointed "
            f"at a time)."
        )
    return best[0]


def _inside_entry(path: str, other: str) -> bool:
    """Whether ``path`` lies inside one of the entries of the list at ``other``."""
    prefix = f"{other}." if other else ""
    return path.startswith(prefix) and path != other


def find_chain(model: nn.Module, blocks: str | None = None) -> tuple[str, nn.ModuleList]:
    """The block chain of ``model``: found by :func:`pick_chain`, or the list at ``blocks``.

    Args:
        model: any ``nn.Module``; an ``nn.ModuleList`` is its own chain.
        blocks: the dotted path of the list to use (``"model.layers"``); ``None``: find it.

    Returns:
        ``(path, module_list)``.

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Module``, or ``blocks`` names a module that
            is not an ``nn.ModuleList``.
        InvalidArgumentError: no chain, an ambiguous one, or ``blocks`` names nothing.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = torch.nn.Linear(4, 8)
        ...         self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        >>> path, chain = find_chain(Net())
        >>> path, len(chain)
        ('layers', 3)
    """
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"{_PREFIX} expected an nn.Module (a model, or its nn.ModuleList of blocks); got "
            f"{type(model).__name__}"
        )
    if blocks is not None:
        try:
            found = model.get_submodule(blocks)
        except AttributeError as exc:
            raise InvalidArgumentError(
                f"{_PREFIX} blocks={blocks!r} names no submodule of {type(model).__name__}; "
                f"pass the dotted path of its nn.ModuleList of blocks (e.g. 'model.layers')"
            ) from exc
        if not isinstance(found, nn.ModuleList):
            raise ArgumentTypeError(
                f"{_PREFIX} blocks={blocks!r} is a {type(found).__name__}, not an nn.ModuleList "
                f"of blocks"
            )
        return blocks, found
    lists = [
        (path, [f"{type(m).__module__}.{type(m).__qualname__}" for m in module])
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
    ]
    path = pick_chain(lists)
    found = model.get_submodule(path) if path else model
    return path, cast("nn.ModuleList", found)  # pick_chain only returns lists
