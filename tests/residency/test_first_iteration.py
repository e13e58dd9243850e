"""The first iteration, before anything is recorded: Flow reads ahead in the order
``ts.manage()`` met the weights (graph/order.py), and keeps the weights read ahead rather than
those already used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import tensorscope as ts
from tensorscope.graph.order import ModuleOrder
from tensorscope.residency import room

MiB = 1 << 20


def test_the_order_guesses_the_keys_after_the_furthest_one_used() -> None:
    order = ModuleOrder(min_bytes=10)
    for key, nbytes in [("embed", 100), ("q", 50), ("norm", 4), ("k", 50), ("head", 100)]:
        order.add(key, nbytes)
    order.add("q", 50)  # registered once
    assert len(order) == 4 and order.upcoming(10) == ["embed", "q", "k", "head"]
    order.advance(["norm", "x"])  # small or unknown keys do not move it
    assert order.cursor == -1
    order.advance(["q", "embed"])
    assert order.upcoming(10) == ["k", "head"]
    assert (order.distance("k"), order.distance("head")) == (1, 2)
    assert order.distance("embed") is None and order.distance("q") is None  # used already
    order.advance(["embed"])  # a backward pass: never back
    assert order.upcoming(1) == ["k"]
    order.restart()
    assert order.upcoming(1) == ["embed"]
    order.clear()
    assert len(order) == 0 and order.upcoming(5) == []


def _stack(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint of 6 linears with 1 MiB weights; an input and the plain model's output."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    x = torch.randn(4, 512)
    with torch.no_grad():
        return x, model(x)


def _first_forward_tiers(path: Path, x: torch.Tensor) -> tuple[list[str], torch.Tensor, int]:
    """The tier of each layer's weight as its layer begins, during the first forward."""
    manager = ts.residency
    manager.configure(device="cpu", policy="flow", budget=int(3.5 * MiB))
    with ts.empty_init():
        model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))
    tiers: list[str] = []
    for layer in model:
        layer.register_forward_pre_hook(lambda m, args: tiers.append(manager.tier_of(m.weight)))
    handle = ts.manage(model, checkpoint=path)
    try:
        with torch.no_grad():
            out = model(x).clone()
        report = manager.report()
    finally:
        handle.remove()
    assert report.tiers["device"].peak_bytes <= int(3.5 * MiB)
    return tiers, out, report.prefetches


@pytest.mark.strict
def test_the_first_forward_reads_the_next_layers_ahead(tmp_path: Path) -> None:
    path = tmp_path / "stack.safetensors"
    x, expected = _stack(path)
    tiers, out, prefetched = _first_forward_tiers(path, x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert tiers[0] == "disk"  # nothing used yet: the first weight is read when needed
    assert tiers[1:] == ["device"] * 5, tiers  # each next one was read ahead
    assert prefetched >= 5


@pytest.mark.strict
def test_without_the_guess_each_weight_waits_for_its_op(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "stack.safetensors"
    x, expected = _stack(path)
    monkeypatch.setattr(ts.residency.order, "min_bytes", 1 << 62)  # no weight qualifies
    tiers, out, prefetched = _first_forward_tiers(path, x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert tiers == ["disk"] * 6 and prefetched == 0


@pytest.mark.strict
def test_weights_already_used_are_evicted_before_those_read_ahead(tmp_path: Path) -> None:
    path = tmp_path / "stack.safetensors"
    x, _ = _stack(path)
    manager = ts.residency
    manager.configure(device="cpu", policy="flow", budget=int(3.5 * MiB))
    with ts.empty_init():
        model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))
    handle = ts.manage(model, checkpoint=path)
    names = {manager.placement_of(layer.weight).uid: f"w{i}" for i, layer in enumerate(model)}
    ranked: list[str] = []

    def victims_at_layer_3(module: nn.Module, args: object) -> None:
        budget = manager.budget_bytes or 0
        every = room.victims(
            manager.ledger,
            manager.policy,
            manager.recorder(),
            budget,
            manager.clock,
            budget,
            manager.order,
        )
        ranked.extend(names[p.uid] for p in every if p.uid in names)

    model[3].register_forward_pre_hook(victims_at_layer_3)
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    used = [name for name in ranked if name in {"w0", "w1", "w2"}]
    ahead = [name for name in ranked if name not in used]
    assert used and ahead, ranked  # resident at layer 3: some used, some read ahead
    # Every used weight comes before every weight read ahead (and not yet used).
    assert ranked == used + ahead
