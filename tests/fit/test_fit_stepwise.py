"""A kept-gradient step one parameter at a time (fit/statestore.py, NOTE [a kept-gradient step
one parameter at a time]): with gradients kept (clipping) and the optimizer state in the next
tier, ``optimizer.step()`` reads back one parameter's state at a time, bit-identical to the
whole step, gives the gradients back, and ts.fit plans for it (a budget only that fits)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope import _step_hooks
from tensorscope.fit.parts.states import OptimizerStates
from tensorscope.fit.statestore import MIN_SPILL_BYTES, StateStore

from .fit_helpers import batches, big_vocabulary, differing, optimizer, step, twin
from .test_fit_state_rows import OPTIMIZERS, SHORT

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(33, 97), nn.Tanh(), nn.Linear(97, 41), nn.Tanh(), nn.Linear(41, 3)
    )


def _resident_states(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> int:
    """Parameters whose (spillable-sized) state is in memory now."""
    return sum(
        any(
            isinstance(v, torch.Tensor) and v.device.type != "meta" and v.nbytes >= MIN_SPILL_BYTES
            for v in opt.state.get(p, {}).values()
        )
        for p in params
    )


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("block", [0, 4096])
def test_a_step_one_parameter_at_a_time_equals_the_whole_step(kind: str, block: int) -> None:
    mine = _net()
    theirs = twin(mine)
    make: Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer] = OPTIMIZERS[kind]
    opt, ref = make(mine.parameters()), make(theirs.parameters())
    params = list(mine.parameters())
    store = StateStore(opt)
    store.enabled = store.stepwise = True
    store.set_row_block(block)
    store.spill(dict(opt.state))  # as ts.fit does (Adagrad makes its state in its constructor)
    most = [0]

    def count(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is opt and store.stepping:
            most[0] = max(most[0], _resident_states(opt, params))

    seen = _step_hooks.add_post(count)
    try:
        for i in range(4):
            x = torch.randn(16, 33, generator=torch.Generator().manual_seed(i))
            for net in (mine, theirs):
                net(x).square().sum().backward()
                nn.utils.clip_grad_norm_(net.parameters(), 0.5)  # reads every gradient
            grads = [p.grad for p in params]
            opt.step()
            ref.step()
            assert [p.grad for p in params] == grads  # given back, the same tensors
            assert not differing(mine, theirs), i
            assert _resident_states(opt, params) == 0  # all of it out between steps
            opt.zero_grad()
            ref.zero_grad()
        assert store.stepwise_updates == 4 * len(params)
        # one parameter's state in memory at a time (in row blocks: one block of it, held apart
        # from the parameter's own entry, after the first step made it whole)
        assert most[0] == 1 if not block else most[0] <= 1
        if block:
            assert store.block_updates > 0
        store.fetch_all()
        for p, q in zip(params, theirs.parameters(), strict=True):
            for key, value in ref.state[q].items():
                assert torch.equal(opt.state[p][key], value), (kind, key)
    finally:
        seen.remove()
        store.close()


def test_a_step_given_a_closure_runs_whole() -> None:
    mine = _net()
    opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    store = StateStore(opt)
    store.enabled = store.stepwise = True
    x = torch.randn(4, 33)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = mine(x).square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert store.stepwise_updates == 0 and opt.state
    store.close()


def test_an_update_that_raises_gives_every_gradient_back() -> None:
    mine = _net()
    opt = torch.optim.AdamW(mine.parameters())
    store = StateStore(opt)
    store.enabled = store.stepwise = True
    mine(torch.randn(4, 33)).sum().backward()
    params = list(mine.parameters())
    grads = [p.grad for p in params]
    params[3].grad = torch.zeros(41).to_sparse()  # AdamW refuses a sparse gradient
    grads[3] = params[3].grad
    with pytest.raises(RuntimeError):
        opt.step()
    assert [p.grad for p in params] == grads
    store.close()


def _least_kept(monkeypatch: pytest.MonkeyPatch, stepwise: bool) -> int:
    """The least budget of the candidate with gradients kept and the state offloaded."""
    monkeypatch.setattr(OptimizerStates, "stepwise_ok", property(lambda self: stepwise))
    model = big_vocabulary("gpt2")  # short sequences: the optimizer step is the peak
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget="1GiB")
    step(model, opt, next(batches("gpt2", seq=SHORT)), clip=1.0)
    assert fit.decision is not None and not fit.decision.free_gradients
    fit.remove()
    return min(c.least_budget for c in fit.decision.candidates if c.base.state_offloaded)


@pytest.mark.filterwarnings(
    "ignore:.*(the measuring step|first step):tensorscope.errors.FitWarning"
)
@pytest.mark.strict  # the state moves one parameter at a time (tests/conftest.py)
def test_fit_with_clipping_steps_one_parameter_at_a_time_when_only_that_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    whole, each = _least_kept(monkeypatch, False), _least_kept(monkeypatch, True)
    assert each < whole, (each, whole)
    budget = (whole + each) // 2
    monkeypatch.undo()
    model = big_vocabulary("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    mine, theirs = batches("gpt2", seq=SHORT), batches("gpt2", seq=SHORT)
    for i in range(5):
        ours = step(model, opt, next(mine), clip=1.0, seed=i)
        assert ours == step(ref, ropt, next(theirs), clip=1.0, seed=i)
        assert not differing(model, ref), i
    d = fit.decision
    assert d is not None and not d.free_gradients and d.chosen.base.state_offloaded
    assert "clip_grad_norm_" in " ".join(fit.grads_kept_because)
    assert fit._states.store is not None and fit._states.store.stepwise_updates > 0
    assert "optimizer.step() run one parameter at a time" in fit.explain()
    assert fit.plan_after is not None and fit.plan_after.peak_bytes <= budget
    assert fit.steps == 5  # the per-parameter steps are not counted as steps
    sa, sb = opt.state_dict()["state"], ropt.state_dict()["state"]
    for k in sb:
        for key, value in sb[k].items():
            assert torch.equal(sa[k][key], value), (k, key)
    fit.remove()
