"""Where a fit keeps model state, and why no block is offloaded: ``explain()``'s words for what
the parts hold now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorscope._units import format_bytes
from tensorscope.checkpoint.offloaded import OFFLOAD_MIN_BYTES
from tensorscope.fit.decider import managed

if TYPE_CHECKING:
    from tensorscope.checkpoint.blocks import CheckpointedChain
    from tensorscope.fit.decide import Decision
    from tensorscope.fit.parts.place import ParamPlacement
    from tensorscope.fit.parts.states import OptimizerStates

__all__ = ["offload_why_not", "state_where"]


def offload_why_not(
    optimizer: torch.optim.Optimizer, chain: CheckpointedChain | None, off: str
) -> str:
    """Why no block's saved tensors are offloaded, when none is."""
    if off:
        return off
    if managed(optimizer):
        return "the model is under ts.manage"
    if chain is None or chain.profile is None:
        return "no block chain measured"
    return f"no block saves tensors of {format_bytes(OFFLOAD_MIN_BYTES)} or more of its own"


def state_where(
    optimizer: torch.optim.Optimizer,
    decision: Decision | None,
    place: ParamPlacement,
    states: OptimizerStates,
) -> str:
    """Where parameters, gradients and optimizer state live under ``decision``."""
    if managed(optimizer):
        return "managed by ts.manage: the residency manager's tiers under its own budget"
    base = decision.chosen.base if decision is not None else None
    placer = place.placer
    in_files = base is not None and base.placed_bytes > 0 and placer is not None
    placed = f"; the chain's parameters stay in memory ({place.off})" * bool(place.off)
    if in_files and placer is not None:
        placed = (
            f"; the chain's parameters ({format_bytes(placer.placed_nbytes)}) in the "
            f"disk tier's files between their uses, one block's mapped in at a time "
            f"(NOTE [parameters between their uses])"
        )
    store = states.store
    if base is not None and base.state_offloaded and store is not None:
        when = "read back for optimizer.step()"
        if base.free_gradients or store.stepwise:
            when = (
                "one parameter's read back for its update inside backward"
                if base.free_gradients
                else "optimizer.step() run one parameter at a time, each one's read back "
                "for its update"
            )
            if store.row_block:
                when += (
                    f", state above {format_bytes(store.row_block)} a block of rows "
                    f"at a time ({store.block_updates} such updates so far)"
                )
        return (
            f"{'other ' if in_files else ''}parameters and gradients resident on the device; "
            f"optimizer state in the "
            f"{store.tier} tier between updates ({when}; "
            f"{format_bytes(base.offloaded_bytes)} written and read each step)" + placed
        )
    if in_files:
        return "other parameters, gradients and optimizer state resident on the device" + placed
    return "resident on the device (parameters not moved: see docs/fit.md, model state)" + placed
