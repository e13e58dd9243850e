"""The budget against a caching allocator's reserved bytes (fit/handle.py, NOTE [the budget on a
caching allocator]), with a backend that reports an allocator on the CPU: reserved above the
budget in the recorded step is an excess, decided again with it held back; explain() shows
allocated and reserved; the CPU (no allocator) is unchanged."""

from __future__ import annotations

from typing import Any

import pytest

import tensorscope as ts
from tensorscope.errors import FitWarning
from tensorscope.fit import handle
from tensorscope.residency.backends import backend_for

from .fit_helpers import batches, differing, optimizer, plain_peak, step, tiny, twin

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


class Allocator:
    """The CPU backend, reporting a caching allocator whose reserved peak is ``reserved``."""

    def __init__(self, reserved: int) -> None:
        self.cpu = backend_for("cpu")
        self.reserved = reserved
        self.resets = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cpu, name)

    def allocator_bytes(self) -> tuple[int, int]:
        return self.reserved, self.reserved // 2

    def reset_allocator_peaks(self) -> None:
        self.resets += 1

    def allocator_peaks(self) -> tuple[int, int]:
        return self.reserved, self.reserved // 2


def test_reserved_above_the_budget_is_an_excess_decided_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    budget = int(plain_peak("gpt2", "adamw") * 0.8)
    fake = Allocator(reserved=int(budget * 1.2))
    monkeypatch.setattr(handle, "backend_for", lambda device: fake)
    model = tiny("gpt2")
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    try:
        data, ref_data = batches("gpt2"), batches("gpt2")
        with pytest.warns(FitWarning, match="reserved by the caching allocator"):
            for k in range(4):
                assert step(model, opt, next(data), seed=k) == step(
                    ref, ref_opt, next(ref_data), seed=k
                )
        assert differing(model, ref) == []
        margin = int(budget * handle.FRAGMENTATION_MARGIN)
        excess = fake.reserved - budget
        assert fit._decider.slack == margin + excess
        assert fake.resets == 1  # at the start of the recorded step under the decision
        assert any("caching allocator" in note for note in fit.notes)
        fake.reserved = budget // 2  # the allocator now holds less: within the budget
        for k in range(4, 7):
            step(model, opt, next(data), seed=k)
        assert fit.allocator_peaks == (budget // 2, budget // 4)
        assert "(the budget holds against reserved)" in fit.explain()
    finally:
        fit.remove()


def test_without_a_caching_allocator_nothing_is_held_back() -> None:
    model = tiny("gpt2")
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget=int(plain_peak("gpt2", "adamw") * 0.8))
    try:
        data = batches("gpt2")
        for k in range(4):
            step(model, opt, next(data), seed=k)
        assert fit.plan_after is not None
        assert fit.allocator_peaks == (None, None) and fit._decider.slack == 0
        assert "reserved" not in fit.explain()
    finally:
        fit.remove()
