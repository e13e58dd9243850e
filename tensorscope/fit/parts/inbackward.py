"""The in-backward updates part: each parameter updated, and its gradient freed, inside backward
when a decision frees gradients (NOTE [the update inside backward], fit/inbackward.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tensorscope.checkpoint.blocks import CheckpointedChain
from tensorscope.fit.gradreaders import listen
from tensorscope.fit.inbackward import InBackward
from tensorscope.fit.parts import Decided, Part, Step
from tensorscope.fit.parts.states import OptimizerStates

__all__ = ["InBackwardUpdates"]


class InBackwardUpdates(Part):
    """Holds the hooks while a decision frees gradients (none in a measured step: it keeps
    gradients, as step 1 did).

    Attributes:
        hooks: the hooks, while they are on.
    """

    def __init__(self, states: OptimizerStates, chain: CheckpointedChain | None = None) -> None:
        self.hooks: InBackward | None = None
        self._states = states
        self._chain = chain  # its blocks' parameters updated a block at a time
        self._optimizer: torch.optim.Optimizer | None = None
        # NOTE [a step that reads gradients after the recorded one] (fit/gradreaders.py):
        # told what read gradients this step after updates inside backward had run
        self.on_late_reader: Callable[[str, int], None] | None = None
        self._reading: Any = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def detach(self) -> None:
        self._off()

    def _off(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        if self._reading is not None:
            self._reading.remove()
            self._reading = None

    @property
    def updated_this_step(self) -> int:
        """Parameters updated inside backward since the step began."""
        return len(self.hooks.updated) if self.hooks is not None else 0

    def read_all(self, name: str, params: list[torch.Tensor]) -> None:
        """A gradient reader (``name``, fit/gradreaders.py) is about to read ``params``'
        gradients: some may have been applied and freed inside backward already."""
        hooks = self.hooks
        if hooks is None or not hooks.updated or self.on_late_reader is None:
            return
        updated = {id(p) for p in hooks.updated}
        gone = sum(id(p) in updated for p in params)
        if gone:
            self.on_late_reader(f"{name}()", gone)

    def decide(self, decided: Decided) -> bool:
        if not decided.decision.free_gradients:
            self._off()
            return True
        if self.hooks is None and self._optimizer is not None:
            blocks = self._chain.blocks if self._chain is not None else ()
            units = [list(block.parameters()) for block in blocks]
            self.hooks = InBackward(self._optimizer, units)
            self._reading = listen(self)
        if self.hooks is not None:
            store = self._states.store
            self.hooks.in_rows = store.update_in_rows if self._states.in_rows and store else None
            self.hooks.after_update = self._states.after_update
            # NOTE [a block's parameters updated together]: not where state is fetched per
            # update (the plan counts one parameter's state then: account.step_base)
            self.hooks.grouped = not decided.decision.chosen.base.state_offloaded
        return True

    def step_start(self, step: Step) -> None:
        if step.measured:
            self._off()
        elif self.hooks is not None:
            self.hooks.drop_landed()  # a dead backward's, never applied
            self.hooks.updated = []

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        if self.hooks is None:
            return ()
        self.hooks.drop_landed()
        updated, self.hooks.updated = self.hooks.updated, []
        return updated

    @property
    def stepping(self) -> bool:
        return self.hooks is not None and self.hooks.updating
