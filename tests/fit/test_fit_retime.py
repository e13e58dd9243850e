"""The decision's predicted step time set against the measured one, once (fit/handle.py, NOTE
[a prediction measured against]): far off, the rest of the step is re-timed and the decision
taken again; explain() shows both."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import tensorscope as ts

from .fit_helpers import batches, differing, optimizer, plain_peak, step, tiny, twin

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


class SlowFirst(nn.Module):
    """A model whose first training forward takes ``pause`` seconds longer (a cold cache, a
    first batch read lazily): the recorded step overstates the rest of the step."""

    def __init__(self, inner: nn.Module, pause: float) -> None:
        super().__init__()
        self.inner = inner
        self.pause = pause
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1 and self.pause:
            time.sleep(self.pause)
        return self.inner(x)  # type: ignore[no-any-return]


def test_a_prediction_far_off_is_retimed_once_and_training_stays_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tensorscope.fit import handle

    monkeypatch.setattr(handle, "TIME_TOLERANCE", 0.10)  # the root conftest turns it off
    model = SlowFirst(tiny("mlp"), pause=0.5)
    ref = twin(model)
    ref.pause = 0.0
    opt, ref_opt = optimizer("sgd", model.inner), optimizer("sgd", ref.inner)
    fit = ts.fit(model, opt, budget=plain_peak("mlp", "sgd") * 2)
    try:
        data, ref_data = batches("mlp"), batches("mlp")
        predicted: list[float] = []
        for k in range(8):
            assert step(model, opt, next(data), seed=k) == step(
                ref, ref_opt, next(ref_data), seed=k
            )
            if fit.decision is not None:
                predicted.append(fit.decision.chosen.predicted_s)
        assert differing(model, ref) == []
        notes = [n for n in fit.notes if "against the predicted" in n]
        assert len(notes) == 1, fit.notes  # once
        assert "re-timed x0." in notes[0]  # the half second of step 1 is not in later steps
        assert predicted[-1] < predicted[0] - 0.3
        assert notes[0] in fit.explain()
    finally:
        fit.remove()


def test_a_prediction_near_the_measurement_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorscope.fit import handle

    monkeypatch.setattr(handle, "TIME_TOLERANCE", 1e9)  # any measurement is near enough
    model = tiny("mlp")
    opt = optimizer("sgd", model)
    fit = ts.fit(model, opt, budget=plain_peak("mlp", "sgd") * 2)
    try:
        data = batches("mlp")
        for k in range(7):
            step(model, opt, next(data), seed=k)
        assert fit.decision is not None
        assert not any("against the predicted" in n for n in fit.notes)
        assert fit.measured_step_s is not None  # steps were timed (and checked)
    finally:
        fit.remove()


def test_a_chain_measured_in_a_slow_step_is_retimed_with_the_whole_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the decision is taken on the measuring step's times; when its blocks were slow there,
    # the chain alone is predicted longer than whole later steps: not the rest's error
    from tensorscope.fit import handle

    from .fit_helpers import Block

    monkeypatch.setattr(handle, "TIME_TOLERANCE", 0.10)
    model = tiny("mlp")
    ref = twin(model)
    slow = {"on": False}
    forward = Block.forward

    def sometimes_slow(self: Block, x: torch.Tensor) -> torch.Tensor:
        if slow["on"]:
            time.sleep(0.02)
        return forward(self, x)

    monkeypatch.setattr(Block, "forward", sometimes_slow)
    opt, ref_opt = optimizer("sgd", model), optimizer("sgd", ref)
    fit = ts.fit(model, opt, budget=plain_peak("mlp", "sgd") * 2)
    try:
        data, ref_data = batches("mlp"), batches("mlp")
        for k in range(8):
            slow["on"] = k == 0  # step 1 measures the chain
            assert step(model, opt, next(data), seed=k) == step(
                ref, ref_opt, next(ref_data), seed=k
            )
        slow["on"] = False
        assert differing(model, ref) == []
        notes = [n for n in fit.notes if "against the predicted" in n]
        assert len(notes) == 1, fit.notes
        assert "the whole step re-timed x0." in notes[0], notes
        assert fit.decision is not None and fit.measured_step_s is not None
        # corrected: the prediction now near the measured steps, not the slow step's chain
        assert fit.decision.chosen.predicted_s < 3 * fit.measured_step_s, notes
    finally:
        fit.remove()
