"""The state store part: the optimizer state in the next tier between updates when a decision
says so (NOTE [optimizer state between updates], fit/statestore.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tensorscope.fit.inbackward import parameters_of, unknown_optimizer
from tensorscope.fit.offload_rules import Bandwidth
from tensorscope.fit.parts import Decided, Part, Step
from tensorscope.fit.rows import ROW_BLOCK_BYTES
from tensorscope.fit.statestore import StateStore, row_safe

__all__ = ["OptimizerStates"]


class OptimizerStates(Part):
    """Holds the store (made when first needed: a decision offloads the state, or its
    bandwidth is measured).

    Attributes:
        store: the store, once made.
        in_rows: whether updates of large parameters run in row blocks (NOTE [updates in row
            blocks]) under the decision in force.
        atomic: ``ts.fit(..., atomic=True)``: no kept-gradient step is run one parameter at a
            time (it updates parameters inside the optimizer's pre-hook: NOTE [an aborted step]).
    """

    def __init__(self, atomic: bool = False) -> None:
        self.store: StateStore | None = None
        self.in_rows = False
        self.atomic = atomic
        self._optimizer: torch.optim.Optimizer | None = None
        self._bandwidth: Bandwidth | None = None

    @property
    def known(self) -> bool:
        """Whether ts.fit knows the optimizer (its update of one parameter reads only that
        parameter's gradient and state)."""
        return self._optimizer is not None and unknown_optimizer(self._optimizer) is None

    @property
    def stepwise_ok(self) -> bool:
        """Whether a kept-gradient step can run one parameter at a time (statestore.py NOTE
        [a kept-gradient step one parameter at a time])."""
        return self.known and not self.atomic

    @property
    def row_safe(self) -> bool:
        """Whether row-block updates give the whole update's bits (NOTE [updates in row
        blocks])."""
        return self._optimizer is not None and self.known and row_safe(self._optimizer)

    def row_block(self) -> int:
        """Bytes of a row block (0: state written and updated whole)."""
        return ROW_BLOCK_BYTES if self.row_safe else 0

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def detach(self) -> None:
        if self.store is not None:
            self.store.close()

    def get(self) -> StateStore:
        """The store (made now if it was not)."""
        if self.store is None:
            assert self._optimizer is not None, "attached first"
            self.store = StateStore(self._optimizer, known=self.known)
        return self.store

    @property
    def off(self) -> str:
        """Why the next tier is not used (a write failed: NOTE [a full disk]), else ``""``."""
        return self.store.off if self.store is not None else ""

    def bandwidth(self) -> Bandwidth | None:
        """The store's measured bandwidth below the parameters' device (once); None when the
        tier cannot be written (statestore.py NOTE [a full disk])."""
        store = self.get()
        if self._bandwidth is None and not store.off:
            params = parameters_of(self._optimizer) if self._optimizer is not None else []
            device = next((p.device for p in params), torch.device("cpu"))
            self._bandwidth = store.measure(device)
        return None if store.off else self._bandwidth

    def decide(self, decided: Decided) -> bool:
        decision = decided.decision
        offloaded = decision.chosen.base.state_offloaded
        stepwise = offloaded and not decision.free_gradients and self.stepwise_ok
        self.in_rows = offloaded and (decision.free_gradients or stepwise)
        if offloaded:  # NOTE [updates in row blocks] (statestore.py)
            store = self.get()
            store.enabled = True
            store.stepwise = stepwise
            store.set_row_block(self.row_block() if self.in_rows else 0)
            store.spill_or_warn(dict(store.optimizer.state))
            if store.off:  # NOTE [a full disk] (statestore.py): decided again without
                store.disable()
                return False
        elif self.store is not None:
            self.store.disable()
        return True

    def failed_write(self) -> bool:
        """Whether a write of the state failed in the step that ended (NOTE [a full disk]):
        the state stayed in memory; the store is turned off, to be decided again without."""
        store = self.store
        if store is None or not (store.enabled and store.off):
            return False
        store.disable()
        return True

    def step_start(self, step: Step) -> None:
        if step.measured and self.store is not None:  # resident, as in step 1
            self.store.disable()

    def step_end(self, step: Step | None) -> None:
        if self.store is not None:  # after the recorder's hook: it saw the state resident
            self.store.after_step()

    def after_update(self) -> None:
        """One parameter's update inside backward is done: its state goes out again."""
        if self.store is not None:
            self.store.after_step()

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        if self.store is None:
            return ()
        return self.store.abort()

    @property
    def stepping(self) -> bool:
        return self.store is not None and self.store.stepping
