"""Optimal activation checkpointing (rotor) under a memory limit.

``Checkpointable`` wraps an ``nn.Sequential``: it measures each layer on the first training
batch, solves rotor's dynamic program for the fastest schedule of forward recomputations that
fits ``mem_limit``, and runs forward and backward following it. ``checkpoint_chain`` does the
same for a real model's chain of blocks (HF ``model.layers``, ``transformer.h``...), found by
``find_chain``, while the model's own forward runs. ``solve`` and ``simulate`` work on plain
numbers (a :class:`Chain`) and import no torch. See ``docs/checkpoint.md``.

Example:
    >>> from tensorscope.checkpoint import Chain, solve
    >>> solve(Chain([1, 1], [1, 1], [4, 4, 4], [0, 8, 8], [0, 0], [0, 0]), 24).ops
    (('Fck', 0), ('Fe', 1), ('Loss',), ('B', 1), ('Fe', 0), ('B', 0))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorscope.checkpoint.chain import Chain, Op, Schedule
from tensorscope.checkpoint.find import find_chain, pick_chain
from tensorscope.checkpoint.simulate import Simulation, simulate
from tensorscope.checkpoint.solver import min_memory, solve, store_all_memory

if TYPE_CHECKING:
    from tensorscope.checkpoint.blocks import CheckpointedChain, checkpoint_chain
    from tensorscope.checkpoint.module import Checkpointable

__all__ = [
    "Chain",
    "Checkpointable",
    "CheckpointedChain",
    "Op",
    "Schedule",
    "Simulation",
    "checkpoint_chain",
    "find_chain",
    "min_memory",
    "pick_chain",
    "simulate",
    "solve",
    "store_all_memory",
]


def __getattr__(name: str) -> Any:
    # NOTE [lazy torch]: the solver side is pure Python; torch is imported only when
    # Checkpointable is first used, so `from tensorscope.checkpoint import solve` stays light.
    if name == "Checkpointable":
        from tensorscope.checkpoint.module import Checkpointable

        return Checkpointable
    if name in ("checkpoint_chain", "CheckpointedChain"):
        from tensorscope.checkpoint import blocks

        return getattr(blocks, name)
    raise AttributeError(f"module 'tensorscope.checkpoint' has no attribute {name!r}")
