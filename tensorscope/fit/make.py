"""``ts.fit(...)``: its arguments checked, the handle made (handle.py), a first step that cannot
fit said before it runs."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from tensorscope._sharded import fsdp1_modules
from tensorscope._units import format_bytes, parse_bytes
from tensorscope.errors import ArgumentTypeError, FitWarning, InvalidArgumentError, TensorScopeError
from tensorscope.fit import fitted
from tensorscope.fit.handle import Fit
from tensorscope.fit.ranks import Ranks
from tensorscope.fit.statestore import first_step_floor

__all__ = ["make_fit"]

_SUB = "tensorscope.fit"


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    # accelerate's AcceleratedOptimizer is an Optimizer whose step() steps the one it wraps
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError(
            f"{_SUB}: ts.fit needs a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )
    return optimizer


def make_fit(
    model: Any,
    optimizer: Any,
    budget: Any,
    *,
    blocks: str | None = None,
    atomic: bool = False,
    compiled: Any = False,
) -> Fit:
    """:func:`tensorscope.fit` (see its docstring). With a process group of more than one rank
    initialized, every rank calls it: a tensorscope error on any rank is raised on all of them,
    and every rank takes the smallest budget (NOTE [errors across ranks], fit/ranks.py)."""
    ranks = Ranks.here()
    if ranks is None:
        return _make(model, optimizer, budget, blocks, atomic, None, compiled)
    made: list[Fit] = []

    def local() -> int:
        made.append(_make(model, optimizer, budget, blocks, atomic, ranks, compiled))
        return made[0].budget_bytes

    try:
        budgets = ranks.agree(local)
    except TensorScopeError:
        for fit in made:  # another rank failed: nothing of this one stays, and no rank waits
            fit._across.departed = True
            fit.remove()
        raise
    made[0]._agreed_budget(budgets)
    return made[0]


def _make(
    model: Any,
    optimizer: Any,
    budget: Any,
    blocks: str | None,
    atomic: bool,
    ranks: Ranks | None,
    compiled: Any = False,
) -> Fit:
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"{_SUB}: ts.fit needs an nn.Module; got {type(model).__name__}")
    opt = _unwrap(optimizer)
    nbytes = parse_bytes(budget, what="budget", subsystem=_SUB)
    if not isinstance(atomic, bool):
        raise ArgumentTypeError(f"{_SUB}: ts.fit(atomic=...) takes a bool; got {atomic!r}")
    if not isinstance(compiled, bool):
        raise ArgumentTypeError(f"{_SUB}: ts.fit(compile=...) takes a bool; got {compiled!r}")
    fsdp1 = fsdp1_modules(model)
    if fsdp1:
        raise InvalidArgumentError(
            f"{_SUB}: {type(model).__name__} is wrapped by FullyShardedDataParallel (FSDP1), "
            f"which ts.fit does not plan for (its flat parameters are FSDP1's own). Shard with "
            f"FSDP2 instead: torch.distributed.fsdp.fully_shard on every block, then on the "
            f"model, then make the optimizer and call ts.fit"
        )
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            raise InvalidArgumentError(
                f"{_SUB}: HF gradient checkpointing is on ({name or type(module).__name__}); "
                f"ts.fit decides recomputation itself. Call model.gradient_checkpointing_disable() "
                f"first."
            )
    handle = fitted.claim(
        (model, opt), lambda: Fit(model, opt, nbytes, blocks, atomic, ranks, compiled)
    )
    _warn_if_the_first_step_cannot_fit(opt, nbytes)
    return handle


def _warn_if_the_first_step_cannot_fit(optimizer: torch.optim.Optimizer, budget: int) -> None:
    """Say before it runs that the measuring step will pass the budget: it keeps gradients and
    its ``optimizer.step()`` makes the whole optimizer state (on CUDA: an out-of-memory error
    the user should be able to foresee)."""
    params, grads, state = first_step_floor(optimizer)
    floor = params + grads + (state or 0)
    if floor <= budget:
        return
    parts = f"parameters {format_bytes(params)} + gradients {format_bytes(grads)}"
    if state is None:
        parts += " (+ the state of an optimizer ts.fit does not know)"
    elif state:
        parts += f" + optimizer state {format_bytes(state)}"
    warnings.warn(
        f"{_SUB}: the first step, recorded to measure, keeps every gradient and its "
        f"optimizer.step() makes the whole optimizer state: it holds at least {parts} = "
        f"{format_bytes(floor)}, above the budget of {format_bytes(budget)}. It will pass the "
        f"budget once (on a GPU it may run out of memory); the steps after it run under the "
        f"budget when a plan fits it.",
        FitWarning,
        stacklevel=4,  # the caller of ts.fit()
    )
