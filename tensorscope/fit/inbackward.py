"""Optimizer-in-backward: each parameter updated, and its gradient freed, as soon as autograd has
accumulated it (PyTorch's ``register_post_accumulate_grad_hook`` recipe), with the user's own
optimizer object, its state and its hyperparameters. See NOTE [the update inside backward].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["KNOWN_OPTIMIZERS", "InBackward", "narrowed", "parameters_of", "unknown_optimizer"]

# NOTE [the update inside backward]
# When a parameter's gradient is final (its AccumulateGrad node ran: every use of the
# parameter in the graph has contributed), the hook runs the user's optimizer for that
# parameter alone: the class's `step` (so torch.optim's step hooks and `no_grad` apply) with
# `param_groups` narrowed, for the call, to the parameter's own group holding only it. The
# group dict is the real one (a scheduler's new `lr` is seen; anything the step writes stays),
# and `optimizer.state[p]` is the same state the plain step would use. Then the gradient is
# set to None: its memory goes back at once. The user's `optimizer.step()` afterwards finds no
# gradient and updates nothing (torch's optimizers skip parameters whose `.grad` is None), and
# `zero_grad()` has nothing to do, so the loop stays unchanged and learning-rate schedulers
# still see a step. Only optimizers whose update of one parameter reads that parameter's own
# gradient and state are run this way (KNOWN_OPTIMIZERS, exact classes: a subclass may
# override `step`); on the CPU their per-tensor code is what the plain step runs, so the
# weights are bit-identical to the plain loop's.

KNOWN_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
)


def unknown_optimizer(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be run per parameter, or None when it can.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> unknown_optimizer(torch.optim.AdamW([p])) is None
        True
        >>> print(unknown_optimizer(torch.optim.LBFGS([p]))[:60])
        LBFGS is not an optimizer ts.fit knows to update one paramet
    """
    if type(optimizer) in KNOWN_OPTIMIZERS:
        return None
    names = ", ".join(c.__name__ for c in KNOWN_OPTIMIZERS)
    return (
        f"{type(optimizer).__name__} is not an optimizer ts.fit knows to update one parameter "
        f"at a time (it knows {names})"
    )


# NOTE [a block's parameters updated together]
# Given `units` (a chain's blocks: each block's parameters one unit), the parameters of one unit
# in one parameter group are updated by one narrowed step when the last of their gradients has
# landed, not one step each: the optimizer's own implementation then runs over the unit
# (foreach or fused where the plain step uses them, as on CUDA), and the step's per-call work --
# its hooks, profiler ranges, `no_grad` -- is paid once a block, not once a parameter (~0.1 ms
# a parameter on this machine's CPU). Each element's update is the one the plain step computes.
# A unit's gradients are held until its update (the plan counts them so: plan/whatif.py's
# `together`). A member whose gradient does not come this backward (an unused branch) would
# hold the rest back: what has landed is updated when the backward ends (a callback queued on
# the autograd engine). Where the optimizer state is fetched per update (statestore.py) the
# updates stay one parameter at a time (`grouped` False): the plan counts one parameter's state.


class InBackward:
    """The hooks that run ``optimizer``'s update of each parameter inside backward.

    Example:
        >>> lin = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        >>> hooks = InBackward(opt)
        >>> lin(torch.ones(1, 4)).sum().backward()
        >>> lin.weight.grad is None, hooks.updates
        (True, 2)
        >>> hooks.remove()
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, units: Sequence[Sequence[torch.Tensor]] = ()
    ) -> None:
        self.optimizer = optimizer
        self.updates = 0
        self.updating = False
        self.grouped = True  # NOTE [a block's parameters updated together]
        # runs a parameter's update block by block where its state is written in row blocks
        # (statestore.py); returns False to leave the update whole
        self.in_rows: Callable[[torch.Tensor, Callable[[torch.Tensor], None]], bool] | None = None
        self.after_update: Callable[[], None] | None = None  # after each one's step, narrowed
        self.updated: list[torch.Tensor] = []  # since the last clear(): what abort names
        self._handles: list[Any] = []
        unit_of = {id(p): k for k, ps in enumerate(units) for p in ps}
        # (group, unit) -> its members, in the group's order; a parameter in no unit is alone
        members: dict[tuple[int, int], list[torch.Tensor]] = {}
        seen: set[int] = set()
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                unit = unit_of.get(id(p))
                together = None
                if unit is not None:
                    together = members.setdefault((g, unit), [])
                    together.append(p)
                self._handles.append(
                    p.register_post_accumulate_grad_hook(self._make(group, together))
                )
        self._landed: dict[int, tuple[list[torch.Tensor], dict[str, Any]]] = {}
        self._flush_queued = False

    def _make(self, group: dict[str, Any], together: list[torch.Tensor] | None) -> Any:
        def hook(p: torch.Tensor) -> None:
            if together is None or len(together) < 2 or not self.grouped:
                self.update(p, group)
            else:
                self._land(p, group, together)

        return hook

    def _land(self, p: torch.Tensor, group: dict[str, Any], together: list[torch.Tensor]) -> None:
        if p.grad is None:
            return
        landed, _ = self._landed.setdefault(id(together), ([], group))
        if any(q is p for q in landed):  # a second gradient this backward: the first goes now
            self._flush(together)
            landed, _ = self._landed.setdefault(id(together), ([], group))
        landed.append(p)
        if not self._flush_queued:
            self._flush_queued = True
            queue_callback(self._flush_all)  # at the end of this backward
        if len(landed) == len(together):
            self._flush(together)

    def _flush(self, together: list[torch.Tensor]) -> None:
        landed, group = self._landed.pop(id(together), ([], None))
        if group is None or not landed:
            return
        order = {id(q): i for i, q in enumerate(together)}
        self.update_together(sorted(landed, key=lambda q: order[id(q)]), group)

    def _flush_all(self) -> None:
        self._flush_queued = False
        while self._landed:
            key = next(iter(self._landed))
            landed, group = self._landed.pop(key)
            self.update_together(landed, group)

    def drop_landed(self) -> list[torch.Tensor]:
        """Forget gradients that landed but were not applied (their backward died): their
        gradients are dropped, as the per-parameter updates would never have made them."""
        dropped = [p for landed, _ in self._landed.values() for p in landed]
        self._landed.clear()
        self._flush_queued = False
        for p in dropped:
            p.grad = None
        return dropped

    def update_together(self, ps: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Apply the updates of ``ps`` (one group's) in one narrowed step; free their
        gradients (NOTE [a block's parameters updated together])."""
        ps = [p for p in ps if p.grad is not None]
        if len(ps) < 2:
            for p in ps:
                self.update(p, group)
            return
        self.updating = True
        try:
            with narrowed(self.optimizer, ps, group):
                type(self.optimizer).step(self.optimizer)
                if self.after_update is not None:
                    self.after_update()
        finally:
            self.updating = False
        for p in ps:
            self.updated.append(p)
            p.grad = None
        self.updates += len(ps)

    @contextmanager
    def _only(self, p: torch.Tensor, group: dict[str, Any]) -> Iterator[None]:
        self.updating = True
        try:
            with narrowed(self.optimizer, p, group):
                yield
        finally:
            self.updating = False

    def update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        """Apply ``p``'s update now and free its gradient (NOTE [the update inside backward])."""
        if p.grad is None:
            return

        def step_one(q: torch.Tensor) -> None:
            with self._only(q, group):
                type(self.optimizer).step(self.optimizer)
                if self.after_update is not None:  # narrowed to q, its gradient still there
                    self.after_update()

        if self.in_rows is None or not self.in_rows(p, step_one):
            step_one(p)
        self.updated.append(p)
        p.grad = None
        self.updates += 1

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        while self._handles:
            self._handles.pop().remove()


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the backward running now ends (autograd's engine callback)."""
    engine: Any = torch.autograd.Variable._execution_engine
    engine.queue_callback(fn)


@contextmanager
def narrowed(
    optimizer: torch.optim.Optimizer,
    p: torch.Tensor | list[torch.Tensor],
    group: dict[str, Any],
) -> Iterator[None]:
    """``optimizer.param_groups`` narrowed to ``p``'s own group holding only ``p`` (or the
    parameters listed; the group dict is the real one: a scheduler's ``lr`` is seen, what the
    step writes stays)."""
    groups, params = optimizer.param_groups, group["params"]
    optimizer.param_groups = [group]
    group["params"] = list(p) if isinstance(p, list) else [p]
    try:
        yield
    finally:
        group["params"] = params
        optimizer.param_groups = groups


def parameters_of(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The distinct parameters ``optimizer`` updates, in order."""
    seen: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())
