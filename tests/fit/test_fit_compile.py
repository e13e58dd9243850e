"""A model its user compiles (torch.compile(model) or model.compile(), before or after ts.fit)
trains with the fit's plan: results equal the plain eager loop's, and nothing recompiles once
the decision has settled (NOTE [compiled models and the chain], checkpoint/routes.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts

from .fit_helpers import batches, differing, loss_of, optimizer, plain_peak, tiny, twin

pytestmark = [pytest.mark.engine_independent, pytest.mark.slow]

STEPS = 6
SETTLED = 3  # measured steps 1-2, the decision applied from step 3 on: no compile after it


class CountingBackend:
    """Runs Dynamo's graphs as traced (eager ops: results equal the eager loop's) and counts
    how many it was given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        return gm.forward


def compiled_after(model: nn.Module, backend: CountingBackend) -> nn.Module:
    return torch.compile(model, backend=backend)  # type: ignore[return-value]


def compiled_in_place(model: nn.Module, backend: CountingBackend) -> nn.Module:
    model.compile(backend=backend)
    return model


@pytest.mark.parametrize("order", ["fit_then_compile", "compile_then_fit", "model.compile"])
def test_a_compiled_fitted_model_trains_as_plain_and_stops_compiling(order: str) -> None:
    torch._dynamo.reset()
    budget = int(plain_peak("gpt2", "adamw") * 0.6)  # blocks recomputed: the chain runs
    model = tiny("gpt2")
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    backend = CountingBackend()
    if order == "fit_then_compile":
        fit = ts.fit(model, opt, budget=budget)
        run = compiled_after(model, backend)
    elif order == "compile_then_fit":
        run = compiled_after(model, backend)
        fit = ts.fit(model, opt, budget=budget)
    else:
        run = compiled_in_place(model, backend)
        fit = ts.fit(model, opt, budget=budget)
    graphs = []
    try:
        data, ref_data = batches("gpt2"), batches("gpt2")
        for k in range(STEPS):
            for m, o, d in ((run, opt, data), (ref, ref_opt, ref_data)):
                torch.manual_seed(k)
                loss_of(m, next(d)).backward()
                o.step()
                o.zero_grad()
            graphs.append(backend.graphs)
            assert differing(model, ref) == [], f"step {k + 1}"
        assert fit.decision is not None and "recompute" in fit.decision.blocks
        assert graphs[0] > 0  # it did compile
        assert graphs[SETTLED - 1 :] == [graphs[SETTLED - 1]] * (STEPS - SETTLED + 1), graphs
    finally:
        fit.remove()
        torch._dynamo.reset()
