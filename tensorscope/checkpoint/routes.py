"""A model's blocks routed through a chain's executor: one attach, one symmetric detach.

# NOTE [routing a model's blocks]
# HF models call their blocks in a Python loop, so the chain is driven by the model itself:
# while attached, each block has an instance attribute `forward` (a dispatcher to the chain's
# executor; nn.Module.__call__ looks it up before the class's forward) and nothing else
# changes -- the module tree, state_dict keys, isinstance checks, train()/eval() and hooks stay
# the model's. This is the one place a block's forward is replaced: torch has no hook that runs
# a module's call instead of its forward (a forward pre-hook cannot skip the forward, a forward
# hook only sees its result), and wrapping each block in a module of ours, like HF's
# GradientCheckpointingLayer base class, would rename every parameter while attached: a
# Trainer checkpoint saved then would not load into the model. `detach()` deletes the
# attribute, or restores one that was there before (an accelerate hook), and is idempotent.
#
# NOTE [compiled models and the chain]
# A model compiled by its user (torch.compile(model), model.compile(), before or after the
# chain was attached) reaches the dispatcher while Dynamo traces the model's forward. The
# chain's executor is Python with state (the schedule's cursor, autograd Functions, RNG states,
# weak references), which Dynamo would trace op by op, guard on and recompile at every step;
# so the dispatch is compiler-disabled: the traced graph breaks around each block's call and
# the chain runs as it does in eager mode (compiled code before and after it stays compiled).
# ts.fit(..., compile=True) compiles each block's own forward inside the chain instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from tensorscope._copies import MISSING, Attached, leave_out_of_copies
from tensorscope._torch import compiler_disabled
from tensorscope.errors import InvalidArgumentError

__all__ = ["BlockRoutes", "routed"]

_MISSING = MISSING

Call = Callable[[int, tuple[Any, ...], dict[str, Any]], Any]


class _Dispatch:
    """A block's ``forward`` while it is routed (NOTE [routing a model's blocks])."""

    def __init__(self, call: Call, k: int) -> None:
        self.call = call
        self.k = k

    @compiler_disabled  # NOTE [compiled models and the chain]
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(self.k, args, kwargs)


def routed(block: nn.Module) -> bool:
    """Whether ``block``'s forward is routed through a chain now."""
    return isinstance(block.__dict__.get("forward"), _Dispatch)


class BlockRoutes:
    """The blocks' calls routed to ``call(k, args, kwargs)`` between :meth:`attach` and
    :meth:`detach`; ``forwards`` are the blocks' own (what ran before routing).

    Example:
        >>> import torch
        >>> blocks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        >>> routes = BlockRoutes(blocks, lambda k, args, kwargs: f"block {k}")
        >>> routes.attach(); blocks[1](torch.ones(2))
        'block 1'
        >>> routes.detach(); "forward" in blocks[1].__dict__
        False
    """

    def __init__(self, blocks: Sequence[nn.Module], call: Call) -> None:
        self.blocks = tuple(blocks)
        self.call = call
        self.forwards: list[Callable[..., Any]] = [block.forward for block in self.blocks]
        self.attached = False
        self._saved: list[object] = []
        self._kept_out: list[Attached] = []  # NOTE [copies of a module we attached to]

    def attach(self, what: str = "the chain") -> None:
        """Route every block's call (idempotent while attached).

        Raises:
            InvalidArgumentError: a block is routed already (by another chain).
        """
        if self.attached:
            return
        for k, block in enumerate(self.blocks):
            if routed(block):
                raise InvalidArgumentError(
                    f"tensorscope.checkpoint: block {k} of {what} is already routed by a "
                    f"checkpoint_chain; remove() that one first"
                )
        self._saved = [block.__dict__.get("forward", _MISSING) for block in self.blocks]
        self.forwards = [block.forward for block in self.blocks]
        for k, block in enumerate(self.blocks):
            block.forward = _Dispatch(self.call, k)
            # _copies.py: a copy of the block (deepcopy, pickle) gets its forward as before
            self._kept_out.append(leave_out_of_copies(block, attrs={"forward": self._saved[k]}))
        self.attached = True

    def detach(self) -> None:
        """Give every block its own ``forward`` back (idempotent)."""
        if not self.attached:
            return
        while self._kept_out:
            self._kept_out.pop().remove()
        for block, previous in zip(self.blocks, self._saved, strict=True):
            if previous is _MISSING:
                block.__dict__.pop("forward", None)
            else:
                block.__dict__["forward"] = previous
        self._saved = []
        self.attached = False
