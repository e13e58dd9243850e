"""The parameter placer part: the chain's parameters in the disk tier's files between their uses
when a decision says so (NOTE [parameters between their uses], fit/paramplace.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from tensorscope.checkpoint.blocks import CheckpointedChain
from tensorscope.errors import ResidencyError
from tensorscope.fit.paramplace import ParamPlacer, measure_mapping, placeable
from tensorscope.fit.parts import Decided, Part, Step

__all__ = ["ParamPlacement"]


class ParamPlacement(Part):
    """Places the chain's parameters (or puts them back) as each decision says.

    Attributes:
        placer: the placer, once a decision placed parameters.
        off: why the chain's parameters stay in memory (a failed write), else ``""``.
    """

    def __init__(self, chain: CheckpointedChain | None) -> None:
        self.chain = chain
        self.placer: ParamPlacer | None = None
        self.off = ""
        self._model: nn.Module | None = None
        self._map_rate: float | None = None

    @property
    def placed(self) -> bool:
        """Whether parameters are in files now."""
        return self.placer is not None and self.placer.placed

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model = model

    def detach(self) -> None:
        if self.placer is not None:  # the parameters back in memory, their current values
            self.placer.restore()

    def blocks(self) -> list[list[nn.Parameter]]:
        """Per block of the chain, the parameters that can be placed."""
        if self.chain is None or self._model is None:
            return []
        return placeable(self._model, self.chain.blocks)

    def mapping_rate(self) -> float | None:
        """Bytes per second of mapping a placed block in (measured once); None when the disk
        tier cannot be written (placing is then off)."""
        if self._map_rate is None and not self.off:
            try:
                self._map_rate = measure_mapping()
            except ResidencyError as exc:  # the disk tier cannot be written (a full disk)
                self.off = f"the disk tier cannot be written: {exc}"
        return self._map_rate

    def decide(self, decided: Decided) -> bool:
        placer = self.placer
        if decided.decision.chosen.base.placed_bytes <= 0 or self.chain is None:
            if placer is not None and placer.placed:
                placer.restore()
            return True
        if placer is None:
            placer = self.placer = ParamPlacer(self.blocks())
        placer.place()
        if placer.kept:  # a write failed: those stayed in memory; decided again without
            self.off = f"writing parameters to the disk tier failed: {placer.kept[0]}"
            placer.restore()
            return False
        return True

    def step_start(self, step: Step) -> None:
        if self.placer is not None and step.recorded and not step.measured:
            self.placer.log = [(time.perf_counter(), self.placer.resident)]

    def take_log(self) -> list[tuple[float, int]]:
        """What was mapped in over the recorded step; logging stops."""
        if self.placer is None:
            return []
        log, self.placer.log = self.placer.log or [], None  # logged for the recorded step only
        return log

    def names(self) -> tuple[str, ...]:
        """Names of the parameters in files now (none when not placed)."""
        placer = self.placer
        if placer is None or not placer.placed or self._model is None:
            return ()
        ids = {id(p) for ps in placer.blocks for p in ps}
        return tuple(name for name, p in self._model.named_parameters() if id(p) in ids)

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        if self.placer is not None:
            self.placer.release()  # blocks the step mapped in and did not get to drop
            self.placer.log = None
        return ()
