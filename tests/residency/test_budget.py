"""The budget is a hard limit on accounted device bytes; policies decide what moves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tensorscope as ts

pytestmark = pytest.mark.strict  # moves data through the device backend (tests/conftest.py)

MiB = 1 << 20


def _refs(count: int, nbytes: int) -> list[ts.TensorRef]:
    return [ts.ref(torch.full((nbytes // 4,), float(i))) for i in range(count)]


def test_explicit_promote_makes_room_and_never_exceeds_the_budget() -> None:
    ts.residency.configure(policy="flow", budget=2 * MiB)
    tensors = _refs(4, MiB)
    for t in tensors:
        t.demote()
    for t in tensors:
        t.promote()
        assert ts.residency.report().tiers["device"].resident_bytes <= 2 * MiB
    assert sum(t.tier == "device" for t in tensors) == 2
    assert ts.residency.report().peak_bytes <= 2 * MiB


def test_an_op_too_big_for_the_budget_raises_and_loses_nothing() -> None:
    ts.residency.configure(policy="genoa", budget=1 * MiB)
    a = ts.ref(torch.ones(MiB // 4))
    b = ts.ref(torch.full((MiB // 4,), 2.0))
    a.demote()
    b.demote()
    with ts.scope(), pytest.raises(ts.OutOfBudgetError, match=r"aten\.add.*budget of 1\.0 MiB"):
        a + b
    below = ts.residency.tiers[1]  # where a demotion goes: "disk" below the CPU
    assert a.tier == below and b.tier == below
    ts.residency.configure(budget=4 * MiB)
    with ts.scope():
        total = (a + b).sum().item()
    assert total == 3.0 * (MiB // 4)


def test_genoa_keeps_nothing_on_the_device_between_ops() -> None:
    ts.residency.configure(policy="genoa", budget=8 * MiB)
    a, b = _refs(2, MiB)
    a.demote()  # managed from now on
    b.demote()
    below = ts.residency.tiers[1]
    with ts.scope():
        c = a * 2
        assert a.tier == below and c.tier == below  # operands and result demoted right after
        d = c + b
        assert (b.tier, c.tier, d.tier) == (below, below, below)
        assert d[0].item() == 1.0
    assert ts.residency.report().peak_bytes <= 3 * MiB


def test_smaller_budget_demotes_at_once() -> None:
    ts.residency.configure(policy="flow", budget=None)
    tensors = _refs(4, MiB)
    for t in tensors:
        ts.residency.register(t)
    assert ts.residency.report().tiers["device"].resident_bytes == 4 * MiB
    ts.residency.configure(budget=2 * MiB)
    assert ts.residency.report().tiers["device"].resident_bytes <= 2 * MiB
    assert [t[0].item() for t in tensors] == [0.0, 1.0, 2.0, 3.0]


def test_report_is_a_readable_table() -> None:
    ts.residency.configure(policy="genoa", budget="3MiB")
    a = _refs(1, MiB)[0]
    a.demote()
    a.promote()
    rep = ts.residency.report()
    text = str(rep)
    assert "policy genoa" in text and "budget 3.0 MiB" in text
    assert "device" in text and "disk" in text and "transfers: 2 moves" in text
    assert rep.transfers.count == 2 and rep.transfers.bytes == 2 * MiB
    assert rep.tiers["device"].resident_bytes == MiB


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(128, 128)]
    for _ in range(6):
        layers += [nn.ReLU(), nn.Linear(128, 128)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(128, 4))


def _train(model: nn.Module, steps: int, scoped: bool) -> list[float]:
    torch.manual_seed(1)
    data = [(torch.randn(16, 128), torch.randint(0, 4, (16,))) for _ in range(3)]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        x, y = data[step % len(data)]
        if scoped:
            with ts.scope():
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        else:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("policy", ["flow", "genoa"])
def test_training_at_a_third_of_params_grads_and_state_is_bit_identical(policy: str) -> None:
    expected = _train(_mlp(), 4, scoped=False)
    model = _mlp()
    state_bytes = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    budget = state_bytes // 3
    ts.residency.configure(policy=policy, budget=budget)
    handle = ts.manage(model)
    losses = _train(model, 4, scoped=True)
    rep = ts.residency.report()
    assert losses == expected
    assert rep.peak_bytes <= budget
    assert rep.tiers[ts.residency.tiers[1]].placements > 0  # params, grads or Adam state demoted
    reference = _mlp()
    _train(reference, 4, scoped=False)
    handle.remove()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert type(ours) is nn.Parameter and torch.equal(ours, theirs)
    assert ts.residency.managed_count() == 0
    assert torch._C._len_torch_dispatch_stack() == 0


def test_grads_and_optimizer_state_of_managed_parameters_are_managed() -> None:
    model = _mlp()
    ts.residency.configure(policy="genoa", budget="1MiB")
    handle = ts.manage(model)
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        with ts.scope():
            model(torch.randn(16, 128)).square().mean().backward()
            opt.step()
    param_tiers = {ts.residency.tier_of(p) for p in model.parameters()}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(ts.residency.placement_of(g) is not None for g in grads)
    state = [v for p in model.parameters() for k, v in opt.state[p].items() if k != "step"]
    assert len(state) == 2 * len(grads)
    assert all(ts.residency.placement_of(v) is not None for v in state)
    assert param_tiers == {ts.residency.tier_of(v) for v in state} == {ts.residency.tiers[1]}
    handle.remove()
    assert all(ts.residency.placement_of(g) is None for g in grads + state)


def test_activations_in_a_scope_are_managed_and_demoted_under_pressure() -> None:
    model = _mlp()
    ts.residency.configure(policy="flow", budget=None)
    handle = ts.manage(model)
    with ts.scope():
        h = model[0](torch.randn(64, 128))
        assert ts.residency.placement_of(h) is not None  # an activation of a managed op
        h.demote()
        assert h.tier == ts.residency.tiers[1]
        h.sum().backward()
        assert model[0].weight.grad is not None
    handle.remove()


def test_flow_demotes_activations_in_forward_and_prefetches_them_for_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())])
    reference = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())])
    reference.load_state_dict(model.state_dict())
    x = torch.randn(512, 64)  # activations (128 KiB each) outweigh the parameters (16 KiB each)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    ts.residency.configure(policy="flow", budget=param_bytes + 4 * 128 * 1024)
    handle = ts.manage(model)
    for step in range(3):
        with ts.scope():
            before = {p.uid for p in ts.residency.ledger.placements.values()}
            out = model(x)
            activations = [
                p for p in ts.residency.ledger.placements.values() if p.uid not in before
            ]
            assert len(activations) >= 6  # the Tanh outputs saved for backward (at least)
            on_disk = sum(p.tier == ts.residency.tiers[1] for p in activations)
            ts.residency.report(reset=True)
            out.pow(2).mean().backward()
            prefetched = ts.residency.report().prefetches
        reference(x).pow(2).mean().backward()
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad)  # same gradients, wherever data went
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        if step > 0:  # from the second step on, the recorded first step predicts next uses
            assert on_disk > 0  # activations went down a tier (the disk below the CPU) in forward
            assert prefetched > 0  # and came back ahead of their use in the backward
        assert ts.residency.report().peak_bytes <= ts.residency.budget_bytes
    handle.remove()


def test_nothing_accumulates_across_managed_training_steps() -> None:
    model = _mlp()
    ts.residency.configure(policy="flow", budget=200_000)
    handle = ts.manage(model)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 128)
    seen = []
    for _ in range(6):
        with ts.scope():
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        seen.append(
            (ts.residency.managed_count(), len(ts.residency.ops.estimates.cache), ts.stats().live)
        )
    assert len(set(seen[1:])) == 1, seen  # placements, cached op signatures, live refs
    handle.remove()


@pytest.mark.parametrize("policy", ["flow", "genoa"])
def test_grads_made_outside_scopes_are_managed_within_the_budget(policy: str) -> None:
    """A ``.grad`` autograd makes from unmanaged tensors (a backward outside any scope, with a
    plain input) is the parameter's gradient all the same: managed, counted, under the budget."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))
    model.load_state_dict(reference.state_dict())
    budget = 40 * 1024  # weights 34 KiB, with their gradients 68 KiB
    ts.residency.configure(policy=policy, budget=budget)
    handle = ts.manage(model)
    for net in (model, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            net(x).square().mean().backward()  # no scope
            optimizer.step()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and ts.residency.placement_of(g) is not None for g in grads)
    report = ts.residency.report()
    assert report.peak_bytes <= budget and report.tiers[ts.residency.tiers[1]].peak_bytes > 0
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs) and torch.equal(ours.grad, theirs.grad)
    handle.remove()


def test_a_cat_of_managed_tensors_larger_than_the_budget_runs_in_pieces() -> None:
    """Outside a scope the result of ``torch.cat`` is not managed, so only its operands must
    fit, one group at a time (DDP flattens every parameter so to broadcast them)."""
    torch.manual_seed(0)
    tensors = [ts.ref(torch.randn(1024)) for _ in range(6)]  # 4 KiB each, 24 KiB in all
    expected = torch.cat([t.detach().clone() for t in tensors])
    ts.residency.configure(policy="flow", budget=10 * 1024)
    for t in tensors:
        t.demote()
    ts.residency.report(reset=True)
    assert torch.equal(torch.cat(tensors), expected)
    assert torch.equal(
        torch.cat([t.view(32, 32) for t in tensors], dim=1),
        expected.view(6, 32, 32).permute(1, 0, 2).reshape(32, 192),
    )
    assert ts.residency.report().peak_bytes <= 10 * 1024
    with ts.scope(), pytest.raises(ts.OutOfBudgetError, match="cat"):
        torch.cat(tensors)  # in a scope the result is managed: it must fit with its operands
