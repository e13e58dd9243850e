"""A fit is a sequence of parts (NOTE [fit as parts]) moving through one table of phases
(NOTE [steps of a fit]): the order is declared once, detach undoes attach in reverse, a part that
fails to attach leaves nothing behind, and a fitted model's blocks are routed only between the
chain part's attach and detach."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.fit.parts import Decided, Part, Parts, Step
from tensorscope.fit.phase import TRANSITIONS, Event, Phase, advance

from .fit_helpers import optimizer, plain_peak, step, tiny


class Logged(Part):
    """A part that writes down the events it gets."""

    def __init__(self, name: str, log: list[str], fail: str = "") -> None:
        self.name, self.log, self.fail = name, log, fail

    def _note(self, event: str) -> None:
        self.log.append(f"{event} {self.name}")
        if event == self.fail:
            raise RuntimeError(f"{self.name} fails at {event}")

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._note("attach")

    def detach(self) -> None:
        self._note("detach")

    def decide(self, decided: Decided) -> bool:
        self._note("decide")
        return self.fail != "refuse"

    def step_start(self, step: Step) -> None:
        self._note("start")

    def forward_start(self, step: Step) -> None:
        self._note("forward")

    def forward_end(self, step: Step) -> None:
        self._note("returned")

    def abort(self, step: Step) -> Sequence[torch.Tensor]:
        self._note("abort")
        return [torch.zeros(1)] if self.name == "b" else []


def _parts(log: list[str], fail: dict[str, str] | None = None) -> Parts:
    fail = fail or {}
    return Parts([Logged(name, log, fail.get(name, "")) for name in "abc"])


def test_events_run_in_the_declared_order_and_undo_in_reverse() -> None:
    log: list[str] = []
    parts = _parts(log)
    net = nn.Linear(2, 2)
    parts.attach(net, torch.optim.SGD(net.parameters(), lr=0.1))
    step = Step(1, True, True, 0, False)
    parts.step_start(step)
    parts.forward_start(step)
    parts.forward_end(step)
    updated = parts.abort(step)
    parts.detach()
    parts.detach()  # idempotent: nothing attached any more
    assert log == [
        *("attach a", "attach b", "attach c"),
        *("start a", "start b", "start c"),
        *("forward a", "forward b", "forward c"),
        *("returned c", "returned b", "returned a"),
        *("abort c", "abort b", "abort a"),
        *("detach c", "detach b", "detach a"),
    ]
    assert len(updated) == 1  # what b said stays updated


def test_a_part_that_cannot_attach_leaves_the_others_detached() -> None:
    log: list[str] = []
    parts = _parts(log, {"c": "attach"})
    net = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="c fails at attach"):
        parts.attach(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert log == ["attach a", "attach b", "attach c", "detach b", "detach a"]


def test_every_part_is_detached_and_aborted_whatever_another_raises() -> None:
    log: list[str] = []
    parts = _parts(log, {"b": "detach", "a": "abort"})
    net = nn.Linear(2, 2)
    parts.attach(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="a fails at abort"):
        parts.abort(Step(1, False, False, 0, False))
    with pytest.raises(RuntimeError, match="b fails at detach"):
        parts.detach()
    assert log[-6:] == ["abort c", "abort b", "abort a", "detach c", "detach b", "detach a"]


def test_a_part_that_cannot_apply_a_decision_stops_it() -> None:
    log: list[str] = []
    parts = _parts(log, {"b": "refuse"})
    assert not parts.decide(None)  # type: ignore[arg-type]
    assert log == ["decide a", "decide b"]


def test_the_phases_move_only_as_the_table_says() -> None:
    for phase in Phase:
        for event in Event:
            if (phase, event) in TRANSITIONS:
                assert advance(phase, event) is TRANSITIONS[phase, event]
            else:
                with pytest.raises(RuntimeError, match="internal error"):
                    advance(phase, event)
    # an aborted step goes back to where it began
    assert advance(Phase.MEASURING, Event.ABORT) is Phase.MEASURE
    assert advance(Phase.RUNNING, Event.ABORT) is Phase.DECIDED
    assert advance(Phase.REMEASURING, Event.ABORT) is Phase.DECIDED
    assert all(advance(phase, Event.REMOVE) is Phase.REMOVED for phase in Phase)


def test_a_fit_moves_through_its_phases() -> None:
    model = tiny("mlp")
    opt = optimizer("sgd", model)
    fit = ts.fit(model, opt, budget=plain_peak("mlp", "sgd"))
    assert fit._phase is Phase.MEASURE and "measure>" in repr(fit)
    routed = [block for block in model.layers if "forward" in block.__dict__]
    assert len(routed) == len(model.layers)  # the chain part is attached
    out = model(torch.randn(8, 16))
    assert fit._phase is Phase.MEASURING
    out.square().mean().backward()
    opt.step()
    assert fit._phase is Phase.DECIDED and fit.decision is not None
    step(model, opt, {"x": torch.randn(8, 16)})
    assert fit._phase is Phase.DECIDED and fit.steps == 2
    fit.remove()
    assert fit._phase is Phase.REMOVED and not any("forward" in b.__dict__ for b in model.layers)
