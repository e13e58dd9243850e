"""What a fit decides from: the recorded step, the measured chain, the parts' measurements and the
budget (less what a measured excess held back). The decision itself is pure (decide.py); this
gathers its inputs from torch objects and the parts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tensorscope.checkpoint.offloaded import OffloadModel
from tensorscope.errors import ScheduleError
from tensorscope.fit.account import StepBase, logits_rows, step_base
from tensorscope.fit.decide import Candidate, Decision, decide
from tensorscope.fit.inbackward import parameters_of, unknown_optimizer
from tensorscope.fit.parts import Decided
from tensorscope.fit.statestore import per_parameter_state_bytes
from tensorscope.plan.model import MemoryPlan

if TYPE_CHECKING:
    from tensorscope.checkpoint.blocks import CheckpointedChain
    from tensorscope.fit.parts.across import AcrossRanks
    from tensorscope.fit.parts.chunked import ChunkedLoss
    from tensorscope.fit.parts.offload import ActivationOffload
    from tensorscope.fit.parts.place import ParamPlacement
    from tensorscope.fit.parts.states import OptimizerStates

__all__ = ["Decider", "managed"]


def managed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``ts.manage`` manages the optimizer's parameters (it then places the state)."""
    from tensorscope.manage import ManagedParameter

    return any(isinstance(p, ManagedParameter) for p in parameters_of(optimizer))


@dataclasses.dataclass
class Decider:
    """Takes decisions for one fit.

    Attributes:
        slack: bytes held back from the chain's share after measured excesses.
        retries: measured excesses so far (the decision is taken again twice at most).
        outside_scale: the recorded step's time outside the chain is scaled by it (NOTE [a
            prediction measured against], fit/handle.py).
        atomic: ``ts.fit(..., atomic=True)``: gradients are never freed inside backward.
        across: the ranks' agreement (parts/across.py): every rank's reasons and measurements
            merged before deciding (NOTE [one decision across ranks]); None: one process.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    budget: int
    chain: CheckpointedChain | None
    offload: ActivationOffload
    place: ParamPlacement
    states: OptimizerStates
    atomic: bool = False
    chunked: ChunkedLoss | None = None
    slack: int = 0
    retries: int = 0
    across: AcrossRanks | None = None
    outside_scale: float = 1.0  # NOTE [a prediction measured against]: the step outside the chain
    offload_scale: float = 1.0  # the same NOTE: the offload's writes and reads

    @property
    def optimizer_note(self) -> str | None:
        """Why the optimizer cannot be run per parameter (None: it can)."""
        return unknown_optimizer(self.optimizer)

    def why_grads_kept(self, plan: MemoryPlan, forwards: int, grads_at_start: bool) -> list[str]:
        """Why gradients cannot be freed at their update in steps like the recorded one."""
        reasons = []
        if self.atomic:
            reasons.append(
                "ts.fit(..., atomic=True): an update inside backward cannot be undone if the "
                "step is aborted (NOTE [an aborted step])"
            )
        note = self.optimizer_note
        if note is not None:
            reasons.append(note + "; treated conservatively")
        if plan.gradient_readers:
            ops = ", ".join(dict.fromkeys(plan.gradient_readers))
            reasons.append(
                f"the recorded step reads gradients outside backward and the optimizer step "
                f"({ops}: clip_grad_norm_, a GradScaler's unscale_, or your own code): they "
                f"must all exist at once"
            )
        if forwards > 1:
            reasons.append(
                f"gradient accumulation: {forwards} forwards per optimizer step (the "
                f"update needs every micro-batch's gradient)"
            )
        if grads_at_start:
            reasons.append(
                "gradients existed when the step began (accumulated across optimizer steps, "
                "or zero_grad(set_to_none=False))"
            )
        if self.across is not None:  # across ranks: every rank's, and the engine's own
            reasons = self.across.reasons(reasons)
        return reasons

    def chain_paths(self, plan: MemoryPlan) -> list[str]:
        """The chain's blocks' paths in ``plan`` (none: no chain, or not measured)."""
        chain = self.chain
        if chain is None or chain.profile is None:
            return []
        found = [plan.module_ids.get(id(block)) for block in chain.blocks]
        return [p for p in found if p is not None]

    def decide(self, plan: MemoryPlan, free_gradients: bool) -> Decided:
        """The decision for steps like ``plan`` under the budget less the slack.

        Raises:
            ScheduleError: no plan fits; the message names the smallest budget that does.
        """
        chain = self.chain
        measured = chain is not None and chain.profile is not None and self.chain_paths(plan)
        offload = self.offload_model() if measured else None

        def decide_with(bases: list[StepBase]) -> Decision:
            nonlocal offload
            off = self.states.off  # NOTE [a full disk] (statestore.py): after bases() probed
            budget = self.budget
            if self.across is not None:  # NOTE [one decision across ranks]: agreed first
                budget, bases, offload = self.across.inputs(budget, bases, offload)
            return decide(
                budget - self.slack,
                bases,
                chain.profile.to_chain() if measured and chain and chain.profile else None,
                reserve=chain.reserved_nbytes if measured and chain else 0,
                slots=chain.slots if chain is not None else 500,
                what=f"a training step of {type(self.model).__name__}"
                + (f" with the optimizer state in memory ({off})" if off else ""),
                offload=offload,
            )

        try:
            decision = decide_with(self.bases(plan, free_gradients))
        except ScheduleError:
            # NOTE [parameters between their uses]: only when nothing fits without
            if not (measured and self._can_place(free_gradients)):
                raise
            decision = decide_with(self.bases(plan, free_gradients, placed=True))
        return Decided(decision, offload)

    def freed_alternative(self, plan: MemoryPlan) -> Candidate | None:
        """What ``atomic=True`` costs: the plan ts.fit would choose for steps like ``plan``
        without it (None: none fits)."""
        atomic, self.states.atomic = self.states.atomic, False
        try:
            return self.decide(plan, True).decision.chosen
        except ScheduleError:
            return None
        finally:
            self.states.atomic = atomic

    def bases(self, plan: MemoryPlan, free_gradients: bool, placed: bool = False) -> list[StepBase]:
        """The ways of running the step outside the chain; ``placed``: those with the chain's
        parameters in files between their uses (gradients freed at their update only: a
        whole optimizer step would map every parameter in at once)."""
        paths = self.chain_paths(plan)
        where: dict[str, object] = {}
        extra_s = 0.0
        if placed:
            names, window, nbytes = self._placeable(plan)
            where = {"placed": names, "placed_window": window}
            extra_s = 3 * nbytes / (self.place.mapping_rate() or 1.0)  # forward, again, backward
        bases = [] if placed else [self._base(plan, paths, free_gradients=False)]
        if free_gradients:
            bases.append(self._base(plan, paths, free_gradients=True, **where))
        one, tensors = per_parameter_state_bytes(self.optimizer)
        # ts.manage places the state: never both; None: the next tier cannot be written
        bandwidth = self.states.bandwidth() if one and not managed(self.optimizer) else None
        block = self.states.row_block()
        if bandwidth is not None:
            for base in list(bases):
                moved = self._base(
                    plan,
                    paths,
                    free_gradients=base.free_gradients,
                    offload_state=True,
                    state_block=block,
                    stepwise=self.states.stepwise_ok,
                    **(where if base.free_gradients else {}),
                )
                if moved.offloaded_bytes:
                    seconds = bandwidth.seconds(moved.offloaded_bytes, tensors)
                    bases.append(dataclasses.replace(moved, seconds=moved.seconds + seconds))
        if extra_s:
            bases = [
                dataclasses.replace(b, seconds=b.seconds + extra_s) if b.placed_bytes else b
                for b in bases
            ]
        return bases + self._chunked_bases(plan, paths, bases, where, block)

    def _base(self, plan: MemoryPlan, paths: list[str], **how: Any) -> StepBase:
        """``step_base``, its seconds scaled by ``outside_scale``."""
        base = step_base(plan, paths, **how)
        if self.outside_scale == 1.0:
            return base
        return dataclasses.replace(base, seconds=base.seconds * self.outside_scale)

    def _chunked_bases(
        self,
        plan: MemoryPlan,
        paths: list[str],
        bases: list[StepBase],
        where: dict[str, object],
        block: int,
    ) -> list[StepBase]:
        """``bases`` again with the LM head and its loss in row chunks, where the model can run
        them so and the recorded step made logits (NOTE [when the loss runs in chunks])."""
        chunked = self.chunked
        head = chunked.head() if chunked is not None else None
        if chunked is None or head is None or not paths:
            return []
        rows = logits_rows(plan, paths, head[0])
        if not rows:
            return []
        extra = chunked.extra_bytes(rows)
        out = []
        for base in bases:
            again = self._base(
                plan,
                paths,
                free_gradients=base.free_gradients,
                offload_state=base.state_offloaded,
                state_block=block if base.state_offloaded else 0,
                stepwise=base.state_offloaded and self.states.stepwise_ok,
                chunked_head=(head[0], extra),
                **(where if base.free_gradients else {}),
            )
            if again.at_loss < base.at_loss:  # else it holds no less: the plain loss
                out.append(dataclasses.replace(again, seconds=base.seconds))
        return out

    def _placeable(self, plan: MemoryPlan) -> tuple[tuple[str, ...], int, int]:
        """Names of the chain's parameters that can be placed in files, the largest block's
        bytes of them (mapped in at a time) and their total bytes."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        known = {life.name for life in plan.lifetimes if life.category == "parameter"}
        chosen = [[p for p in ps if names.get(id(p)) in known] for ps in self.place.blocks()]
        sizes = [sum(p.untyped_storage().nbytes() for p in ps) for ps in chosen]
        return (
            tuple(names[id(p)] for ps in chosen for p in ps),
            max(sizes, default=0),
            sum(sizes),
        )

    def _can_place(self, free_gradients: bool) -> bool:
        chain = self.chain
        return (
            free_gradients
            and not self.place.off
            and not managed(self.optimizer)
            and chain is not None
            and chain.profile is not None
            and any(self.place.blocks())
            and self.place.mapping_rate() is not None
        )

    def offload_model(self) -> OffloadModel | None:
        """What offloading each block's saved tensors moves (measured in the first step) and
        costs (the next tier's measured bandwidth); None when no block saves enough to move."""
        chain = self.chain
        if chain is None or chain.profile is None or managed(self.optimizer) or self.offload.off:
            return None
        layers = chain.profile.layers
        if not any(layer.offload_nbytes for layer in layers):
            return None
        bandwidth = self.states.bandwidth()
        if bandwidth is None:  # the next tier cannot be written (a full disk)
            return None
        self.offload.tier = bandwidth.tier
        return OffloadModel(
            tuple(layer.offload_nbytes for layer in layers),
            tuple(
                bandwidth.seconds(p.offload_nbytes, p.offload_tensors) * self.offload_scale
                for p in layers
            ),
        )
