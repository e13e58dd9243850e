"""One call of a block: the hidden state, the context it closes over, and what it returns.

A block is called as ``block(hidden, *args, **kwargs)`` (HF's ``GradientCheckpointingLayer``
convention): the first positional argument is the hidden state the chain passes on; everything
else -- attention masks, ``position_embeddings=(cos, sin)``, ``position_ids``, ``None`` caches,
flags -- is the *context*, kept by reference so a recomputation sees exactly the same objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tensorscope.errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "BlockCall",
    "BlockOutput",
    "drop_caches",
    "split_call",
    "split_output",
    "storage_key",
]

_PREFIX = "tensorscope.checkpoint:"

# NOTE [the context of a block call]
# The context is flattened once per call (torch's pytree: tuples, lists, dicts; anything else
# is a leaf). Its tensors are the model's own objects: a mask or a (cos, sin) pair built once
# per step and passed to every block is referenced by every call, so it is stored once -- and
# counted once in the memory model (BlockChain reserves the unique storages of all calls'
# context tensors inside the limit). Context tensors that require grad (a decoder's encoder
# states, T5's position bias) become inputs of the block's autograd Function, so their
# gradients reach the model; a recomputation with autograd uses fresh detached leaves of them.
# A KV cache is dropped from a training call (``drop_caches``), as HF's gradient checkpointing
# does: a recomputed block would write it a second time, and training never reads it.


def storage_key(t: torch.Tensor) -> int:
    """An id of ``t``'s storage (views of one storage share it)."""
    return int(t.untyped_storage()._cdata)


def _is_cache(value: object) -> bool:
    """A transformers ``Cache`` (checked by name: transformers is never imported here)."""
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
        for cls in type(value).__mro__
    )


def _is_empty_cache(value: object) -> bool:
    if not _is_cache(value):
        return False
    length = getattr(value, "get_seq_length", None)
    try:
        return callable(length) and int(length()) == 0
    except Exception:  # a cache class of another shape: not known to be empty
        return False


class BlockCall:
    """The context of one block call, flattened (NOTE [the context of a block call]).

    Attributes:
        grad_tensors: the distinct context tensors that require grad, in leaf order.

    Example:
        >>> import torch
        >>> cos = torch.ones(2)
        >>> x, call = split_call(0, "Block", (torch.zeros(3), None), {"pos": (cos, cos)})
        >>> args, kwargs = call.build(x)
        >>> args[1] is None and kwargs["pos"][0] is cos
        True
    """

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))
        self.grad_tensors: list[torch.Tensor] = []
        self._grad_slot: dict[int, int] = {}  # leaf position -> index in grad_tensors
        index: dict[int, int] = {}
        for i, leaf in enumerate(self.leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                slot = index.setdefault(id(leaf), len(self.grad_tensors))
                if slot == len(self.grad_tensors):
                    self.grad_tensors.append(leaf)
                self._grad_slot[i] = slot

    def build(
        self, hidden: torch.Tensor, grad_leaves: Sequence[torch.Tensor] | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` for calling the block on ``hidden``; context tensors that require
        grad are replaced by ``grad_leaves`` (same order as :attr:`grad_tensors`) if given."""
        leaves = self.leaves
        if grad_leaves is not None and self._grad_slot:
            leaves = list(leaves)
            for i, slot in self._grad_slot.items():
                leaves[i] = grad_leaves[slot]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return (hidden, *args), kwargs

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the context."""
        return [leaf for leaf in self.leaves if isinstance(leaf, torch.Tensor)]


def drop_caches(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """The call without its KV cache: ``Cache`` arguments become ``None``, ``use_cache`` False.

    HF's ``GradientCheckpointingLayer`` does the same in training (with a warning): the model
    passes its cache to every block when ``config.use_cache`` is on, even in ``train()`` mode.
    Only an empty cache is dropped: one holding tokens (a prefix the blocks attend to) would
    change the results, so it stays and ``split_call`` refuses it.
    Returns ``(args, kwargs, dropped)``; the inputs are not modified.
    """
    dropped = False
    if any(_is_empty_cache(a) for a in args):
        args = tuple(None if _is_empty_cache(a) else a for a in args)
        dropped = True
    if kwargs.get("use_cache") or any(_is_empty_cache(v) for v in kwargs.values()):
        kwargs = {key: None if _is_empty_cache(v) else v for key, v in kwargs.items()}
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        dropped = True
    return args, kwargs, dropped


def split_call(
    k: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, BlockCall]:
    """The hidden state and the context of block ``k``'s call ``block(*args, **kwargs)``.

    Raises:
        ArgumentTypeError: the first positional argument is not a floating-point tensor.
        InvalidArgumentError: the call still carries a KV cache (one holding tokens, or nested
            in a container: ``drop_caches`` removes the empty top-level ones).
    """
    if not args or not isinstance(args[0], torch.Tensor):
        got = type(args[0]).__name__ if args else "no positional argument"
        raise ArgumentTypeError(
            f"{_PREFIX} block {k} ({name}) was called with {got} first; the first positional "
            f"argument must be the hidden state tensor the chain passes on (HF's convention: "
            f"block(hidden_states, attention_mask=...)). Pass it positionally."
        )
    x = args[0]
    if not (x.is_floating_point() or x.is_complex()):
        raise ArgumentTypeError(
            f"{_PREFIX} block {k} ({name}) got a {x.dtype} hidden state; the chain must carry "
            f"a floating-point tensor (put embedding lookups before the chain)"
        )
    call = BlockCall(args[1:], kwargs)
    if kwargs.get("use_cache") or any(_is_cache(leaf) for leaf in call.leaves):
        raise InvalidArgumentError(
            f"{_PREFIX} block {k} ({name}) was called with a KV cache (use_cache=True): a "
            f"recomputed block would write the cache a second time. Train with "
            f"use_cache=False (model(..., use_cache=False), or model.config.use_cache = False)."
        )
    return x, call


class BlockOutput:
    """What a block returned: its hidden state, other tensors, and the structure around them.

    Example:
        >>> import torch
        >>> out = split_output(0, "Block", (torch.ones(2), None, torch.zeros(1)))
        >>> out.hidden.shape, len(out.extras)
        (torch.Size([2]), 1)
        >>> out.rebuild([torch.full((2,), 7.0), torch.ones(1)])[0]
        tensor([7., 7.])
    """

    def __init__(self, leaves: list[Any], spec: pytree.TreeSpec) -> None:
        self.leaves = leaves
        self.spec = spec
        self.tensor_positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

    @property
    def hidden(self) -> torch.Tensor:
        """The hidden state passed on to the next block."""
        out: torch.Tensor = self.leaves[0]
        return out

    @property
    def extras(self) -> list[torch.Tensor]:
        """The other tensors the block returned (attention weights...), in order."""
        return [self.leaves[i] for i in self.tensor_positions[1:]]

    def template(self) -> BlockOutput:
        """The same structure without its tensors (holding them would keep them alive)."""
        leaves = [None if isinstance(v, torch.Tensor) else v for v in self.leaves]
        out = BlockOutput(leaves, self.spec)
        out.tensor_positions = self.tensor_positions
        return out

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The block's return value with its tensors replaced by ``tensors`` (hidden first)."""
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_positions, tensors, strict=True):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)


def split_output(k: int, name: str, out: Any) -> BlockOutput:
    """Flatten block ``k``'s return value; its first element must be the hidden state.

    Raises:
        ArgumentTypeError: the block returned no tensor first.
    """
    leaves, spec = pytree.tree_flatten(out)
    if not leaves or not isinstance(leaves[0], torch.Tensor):
        raise ArgumentTypeError(
            f"{_PREFIX} block {k} ({name}) returned {type(out).__name__} whose first element "
            f"is not a tensor; a block must return its hidden state, alone or first in a tuple"
        )
    return BlockOutput(leaves, spec)
