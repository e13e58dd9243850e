"""Our global optimizer-step hooks (``tensorscope/_step_hooks.py``): run in rank order, removed
idempotently, and added or removed from inside a step without failing it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tensorscope import _step_hooks

pytestmark = pytest.mark.engine_independent  # torch.optim hooks (checked)


def _sgd() -> torch.optim.Optimizer:
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    return torch.optim.SGD([param], lr=0.1)


def test_hooks_run_by_rank_then_in_the_order_added() -> None:
    seen: list[str] = []
    before = _step_hooks.active()

    def note(name: str) -> Any:
        return lambda optimizer, args, kwargs: seen.append(name)

    handles = [
        _step_hooks.add_post(note("fit"), rank=1),
        _step_hooks.add_post(note("recorder"), rank=0),
        _step_hooks.add_pre(note("before"), rank=0),
        _step_hooks.add_post(note("recorder 2"), rank=0),
    ]
    try:
        _sgd().step()
    finally:
        for handle in handles:
            handle.remove()
    assert seen == ["before", "recorder", "recorder 2", "fit"]
    assert _step_hooks.active() == before


def test_a_hook_added_or_removed_inside_a_step_waits_for_the_next_step() -> None:
    seen: list[str] = []
    handles: list[_step_hooks.StepHookHandle] = []
    before = _step_hooks.active()

    def first(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        seen.append("first")
        handles[1].remove()  # this step's iteration already holds it
        handles.append(_step_hooks.add_post(lambda *_: seen.append("added")))

    handles.append(_step_hooks.add_post(first))
    handles.append(_step_hooks.add_post(lambda *_: seen.append("second")))
    opt = _sgd()
    opt.step()
    handles[0].remove()
    opt.step()
    for handle in handles:
        handle.remove()
        handle.remove()  # idempotent
    assert seen == ["first", "second", "added"]
    assert _step_hooks.active() == before
