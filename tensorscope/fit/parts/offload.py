"""The activation offloader part: the ``ActivationOffloader`` (fit/offload.py) the chain's
offloaded blocks write their saved tensors through, made when a decision first offloads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tensorscope.checkpoint.offloaded import OFFLOAD_MIN_BYTES
from tensorscope.errors import ResidencyError
from tensorscope.fit.inbackward import parameters_of
from tensorscope.fit.offload import ActivationOffloader
from tensorscope.fit.parts import Decided, Part, Step

__all__ = ["ActivationOffload"]


class ActivationOffload(Part):
    """Holds the offloader (None until a decision offloads a block).

    Attributes:
        offloader: the offloader, once made.
        off: why offload was taken out of the choices (a failed write), else ``""``.
        tier: the tier the decision's offload model was measured for (None: not considered).
        read_ahead: the most bytes read back ahead of use in the last recorded step.
    """

    def __init__(self) -> None:
        self.offloader: ActivationOffloader | None = None
        self.off = ""
        self.tier: str | None = None
        self.read_ahead = 0
        self._optimizer: torch.optim.Optimizer | None = None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def detach(self) -> None:
        if self.offloader is not None:  # graphs still alive keep reading their tensors
            self.offloader.close()

    def decide(self, decided: Decided) -> bool:
        self.read_ahead = 0
        model = decided.offload
        if self.offloader is None and model is not None and decided.decision.chosen.offloaded:
            params = parameters_of(self._optimizer) if self._optimizer is not None else []
            try:
                self.offloader = ActivationOffloader(
                    next((p.device for p in params), torch.device("cpu")),
                    min_bytes=OFFLOAD_MIN_BYTES,
                    max_in_flight_bytes=max(1, model.in_flight_nbytes),
                )
            except ResidencyError as exc:  # its files cannot be made (a full disk)
                self.off = f"the {self.tier} tier cannot be written: {exc}"
                return False  # decided again without offload
        return True

    def step_start(self, step: Step) -> None:
        if self.offloader is not None and step.recorded and not step.measured:
            self.offloader.reset_peak()
            self.offloader.log_read_ahead(True)  # the recorded step's

    def take_log(self) -> list[tuple[float, int]]:
        """What the recorded step read back ahead of use, over time; logging stops."""
        if self.offloader is None:
            return []
        self.read_ahead = self.offloader.stats().peak_read_ahead_bytes
        return self.offloader.log_read_ahead(False)

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        if self.offloader is not None and step.recorded and not step.measured:
            self.offloader.log_read_ahead(False)
        return ()
