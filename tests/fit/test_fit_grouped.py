"""What a fitted step does that plain does not, kept small: a block's parameters updated inside
backward by one narrowed step (fit/inbackward.py, NOTE [a block's parameters updated
together]), and a schedule that keeps every block run without the chain's autograd Function
(checkpoint/blocks.py, NOTE [a schedule that keeps every block]) -- bit-identical to plain."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.checkpoint import blockrun
from tensorscope.fit.inbackward import InBackward
from tensorscope.plan.whatif import _free_gradients, _Intervals

from .fit_helpers import batches, differing, optimizer, plain_peak, step, tiny, twin

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


class Calls:
    """Counts the optimizer's step calls made inside backward, and their sizes."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.sizes: list[int] = []
        self._handle = opt.register_step_pre_hook(self._pre)

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if torch._C._current_graph_task_id() >= 0:  # inside backward
            self.sizes.append(sum(len(g["params"]) for g in opt.param_groups))

    def remove(self) -> None:
        self._handle.remove()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_blocks_parameters_are_updated_by_one_step_bit_identical_to_plain(kind: str) -> None:
    model = tiny("gpt2")
    ref = twin(model)
    opt, ref_opt = optimizer(kind, model), optimizer(kind, ref)
    fit = ts.fit(model, opt, budget=plain_peak("gpt2", kind) * 4)  # everything fits
    calls = Calls(opt)
    try:
        data, ref_data = batches("gpt2"), batches("gpt2")
        for k in range(5):
            calls.sizes.clear()
            assert step(model, opt, next(data), seed=k) == step(
                ref, ref_opt, next(ref_data), seed=k
            )
            assert differing(model, ref) == [], f"step {k + 1}"
        assert fit.decision is not None and fit.decision.free_gradients
        chain = fit.chain
        assert chain is not None
        per_block = len(list(chain.blocks[0].parameters()))
        # one call per block, the parameters outside the chain one call each
        outside = len(list(model.parameters())) - per_block * len(chain.blocks)
        assert sorted(calls.sizes, reverse=True) == [per_block] * len(chain.blocks) + [1] * outside
    finally:
        calls.remove()
        fit.remove()


class TwoWay(nn.Module):
    """A block with a branch some steps skip: its parameters get no gradient then."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.skip_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        return y if self.skip_b else y + torch.tanh(self.b(y))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(TwoWay() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_unit_member_without_a_gradient_holds_nothing_back() -> None:
    net, ref = Net(), Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    hooks = InBackward(opt, [list(layer.parameters()) for layer in net.layers])
    g = torch.Generator().manual_seed(0)
    try:
        for k in range(4):
            x = torch.randn(5, 8, generator=g)
            for m in (net, ref):
                m.layers[1].skip_b = k % 2 == 1  # layer 1's b gets no gradient every other step
            net(x).square().mean().backward()
            assert all(p.grad is None for p in net.parameters())  # applied by the backward's end
            ref(x).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()  # finds no gradient: nothing more
            assert differing(net, ref) == [], f"step {k + 1}"
        assert hooks.updates == 4 * 12 - 2 * 2
    finally:
        hooks.remove()


def test_gradients_of_a_died_backward_are_dropped_not_applied() -> None:
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    hooks = InBackward(opt, [list(layer.parameters()) for layer in net.layers])
    before = [p.detach().clone() for p in net.parameters()]

    def die(grad: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt

    try:
        x = torch.randn(5, 8, requires_grad=True)
        h = net.layers[0](x)
        h.register_hook(die)  # dies after layers 2 and 1 landed their gradients
        out = net.layers[2](net.layers[1](h))
        with pytest.raises(KeyboardInterrupt):
            out.square().mean().backward()
        applied = hooks.updated[:]
        dropped = hooks.drop_landed()
        assert all(p.grad is None for p in net.parameters())
        changed = [not torch.equal(p, q) for p, q in zip(net.parameters(), before, strict=True)]
        ids = {id(p) for p in applied}
        assert changed == [id(p) in ids for p in net.parameters()]
        assert not any(id(p) in ids for p in dropped)
    finally:
        hooks.remove()


def test_a_schedule_that_keeps_every_block_runs_no_block_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny("gpt2")
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=plain_peak("gpt2", "adamw") * 4)
    try:
        data, ref_data = batches("gpt2"), batches("gpt2")
        for k in range(3):  # measured, re-timed with the decision's schedule
            assert step(model, opt, next(data), seed=k) == step(
                ref, ref_opt, next(ref_data), seed=k
            )
        assert fit.decision is not None and set(fit.decision.blocks) == {"keep"}

        def refused(*args: Any) -> Any:
            raise AssertionError("the chain's autograd Function ran")

        monkeypatch.setattr(blockrun.BlockFunction, "apply", refused)
        for k in range(3, 5):
            assert step(model, opt, next(data), seed=k) == step(
                ref, ref_opt, next(ref_data), seed=k
            )
            assert differing(model, ref) == []
    finally:
        fit.remove()


def test_the_plan_holds_a_units_gradients_until_its_last_lands() -> None:
    model = tiny("gpt2")
    opt = optimizer("sgd", model)
    data = batches("gpt2")
    step(model, opt, next(data))
    with ts.record() as rec:
        step(model, opt, next(data))
    plan = rec.plan()
    blocks = [n for n, _ in model.named_modules() if n.count(".") == 2 and ".h." in n]
    assert blocks
    alone, together = _Intervals(plan), _Intervals(plan)
    _free_gradients(alone, [], [])
    _free_gradients(together, [], [], blocks)
    for block in blocks:
        grads = [
            life
            for life in plan.lifetimes
            if life.category == "gradient" and life.name.startswith(block + ".")
        ]
        assert len(grads) > 1
        ends_alone = {alone.parts[life.index][0][1] for life in grads}
        ends_together = {together.parts[life.index][0][1] for life in grads}
        assert len(ends_alone) > 1 and len(ends_together) == 1
        assert ends_together == {max(ends_alone)}
