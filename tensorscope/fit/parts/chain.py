"""The chain executor part: the model's block chain routed through a ``CheckpointedChain``
(docs/checkpoint.md) -- every block checkpointed while the measured step measures it, rotor's
schedule under the decision, its blocks' saved tensors offloaded and parameters placed as the
decision says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tensorscope.checkpoint.blocks import CheckpointedChain, find_blocks
from tensorscope.errors import InvalidArgumentError
from tensorscope.fit.parts import Decided, Part, Step
from tensorscope.fit.parts.across import AcrossRanks
from tensorscope.fit.parts.offload import ActivationOffload
from tensorscope.fit.parts.place import ParamPlacement

__all__ = ["ChainExecutor", "find_the_chain"]


def find_the_chain(model: nn.Module, blocks: str | None) -> tuple[CheckpointedChain | None, str]:
    """The model's chain, not routed yet, and why there is none (``""`` when there is one).

    Raises:
        InvalidArgumentError: ``blocks`` names no usable chain (found ones are only noted).
    """
    try:
        path, found = find_blocks(model, blocks)
    except InvalidArgumentError as exc:
        if blocks is not None:
            raise
        return None, str(exc).removeprefix("tensorscope.checkpoint: ").split(". ")[0]
    chain = CheckpointedChain(
        path, found, None, slots=500, preserve_rng_state=True, loss_tmp_nbytes=0
    )
    return chain, ""


class ChainExecutor(Part):
    """Routes the chain's blocks from attach to detach (NOTE [routing a model's blocks],
    checkpoint/routes.py); applies a decision's schedule, offload and placement to it; FSDP2's
    sharded blocks gathered around their recomputation (NOTE [recomputing a sharded block])."""

    def __init__(
        self,
        chain: CheckpointedChain | None,
        offload: ActivationOffload,
        place: ParamPlacement,
        across: AcrossRanks,
    ) -> None:
        self.chain = chain
        self._offload = offload
        self._place = place
        self._across = across

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.chain is not None:
            self.chain.attach()

    def detach(self) -> None:
        if self.chain is not None:
            self.chain.remove()

    def decide(self, decided: Decided) -> bool:
        chain, chosen = self.chain, decided.decision.chosen
        if chain is None:
            return True
        chain.placer = self._place.placer if self._place.placed else self._across.regather
        if chosen.chain_limit is None:  # the chain was not part of the decision
            return True
        chain.loss_tmp_nbytes = chosen.base.loss_tmp
        offloader = self._offload.offloader if chosen.offloaded else None
        chain.set_offload(offloader, decided.offload, chosen.offloaded)
        chain.compute_sequence(chosen.chain_limit)  # ScheduleError: no plan (Fit fails)
        return True

    def step_start(self, step: Step) -> None:
        if self.chain is not None:
            self.chain.mark()  # what this step's runs change, put back if it is aborted

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        if self.chain is not None:
            self.chain.abort()
        return ()
