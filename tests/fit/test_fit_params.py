"""ts.fit with the chain's parameters in the disk tier's files between their uses (NOTE
[parameters between their uses]): chosen only when nothing fits with them in memory; training
bit-identical to plain; the measured peak within the budget; every access between steps reads
the right values; remove() gives ordinary memory back; a failed write loses nothing."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

import tensorscope as ts
from tensorscope.errors import FitWarning, ResidencyError, ScheduleError
from tensorscope.fit import paramplace
from tensorscope.fit.parts import place

from .fit_helpers import differing, least_batches, least_budget, least_gpt2, seeded_step

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


@pytest.fixture(scope="module")
def budgets() -> tuple[int, int]:
    with pytest.MonkeyPatch.context() as mp:
        unplaced = least_budget(mp)
    return least_budget(None), unplaced


def test_parameters_are_placed_only_when_nothing_fits_without(budgets: tuple[int, int]) -> None:
    placed_least, unplaced_least = budgets
    assert placed_least < unplaced_least  # the chain's parameters were part of the floor
    model = least_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=unplaced_least)
    try:
        for k, ids in enumerate(least_batches(4)):
            seeded_step(model, opt, ids, k)
        assert fit.decision is not None
        assert fit.decision.chosen.base.placed_bytes == 0
        assert fit._place.placer is None
    finally:
        fit.remove()


def test_placed_parameters_train_like_plain_within_the_budget(budgets: tuple[int, int]) -> None:
    placed_least, unplaced_least = budgets
    budget = (placed_least + unplaced_least) // 2
    model = least_gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=budget)
    try:
        for k, ids in enumerate(least_batches(5)):
            assert seeded_step(model, opt, ids, k) == seeded_step(ref, ref_opt, ids, k)
            assert differing(model, ref) == [], f"step {k + 1}"
            # between steps, every parameter reads its value (mapped from the file)
            total = sum(float(p.detach().double().sum()) for p in model.parameters())
            assert total == sum(float(p.detach().double().sum()) for p in ref.parameters())
        assert fit.decision is not None and fit.decision.free_gradients
        chosen = fit.decision.chosen
        assert chosen.base.placed_bytes > 0 and chosen.predicted_peak <= budget
        placer = fit._place.placer
        assert placer is not None and placer.placed and placer.resident == 0
        nbytes = sum(sum(p.untyped_storage().nbytes() for p in ps) for ps in placer.blocks)
        assert placer.placed_nbytes == nbytes > 0
        # one block's parameters at a time, and the peak counts them as mapped in
        assert 0 < placer.peak_resident <= max(placer.block_nbytes)
        assert placer.log is None  # logged for the recorded step only
        assert fit.plan_after is not None
        assert fit.measured_peak(fit.plan_after) <= budget
        assert fit.measured_peak(fit.plan_after) < fit.plan_after.peak_bytes  # counted mapped
        text = fit.explain()
        assert "in the disk tier's files between their uses" in text
        assert "with the chain's parameters counted as mapped in" in text
        state = model.state_dict()
        assert all(torch.equal(state[n], t) for n, t in ref.state_dict().items())
    finally:
        fit.remove()
    assert fit._place.placer is not None and not fit._place.placer.placed
    assert differing(model, ref) == []
    ids = least_batches(6)[5]
    # plain again, same bits
    assert seeded_step(model, opt, ids, 9) == seeded_step(ref, ref_opt, ids, 9)
    assert differing(model, ref) == []


@pytest.mark.engine_dependent  # scopes or ts.manage
def test_inside_a_scope_under_the_python_path_too(budgets: tuple[int, int]) -> None:
    placed_least, unplaced_least = budgets
    model = least_gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=(placed_least + unplaced_least) // 2)
    try:
        for k, ids in enumerate(least_batches(4)):
            with ts.scope():
                loss = seeded_step(model, opt, ids, k)
            assert loss == seeded_step(ref, ref_opt, ids, k)
        assert differing(model, ref) == []
        assert fit.decision is not None and fit.decision.chosen.base.placed_bytes > 0
    finally:
        fit.remove()


def test_copies_saves_and_state_dict_loads_of_placed_parameters(budgets: tuple[int, int]) -> None:
    """What a script does between steps while the chain's parameters are in files: copy the
    model (an EMA, a best model), save it whole or its state_dict, and load a state_dict into
    it (the values written through the mappings, kept when the pages are dropped)."""
    placed_least, unplaced_least = budgets
    model = least_gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=(placed_least + unplaced_least) // 2)
    data = least_batches(8)
    try:
        for k in range(3):
            assert seeded_step(model, opt, data[k], k) == seeded_step(ref, ref_opt, data[k], k)
        placer = fit._place.placer
        assert placer is not None and placer.placed and placer.placed_nbytes > 0
        copied = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save((model, model.state_dict()), buffer)
        buffer.seek(0)
        loaded, loaded_state = torch.load(buffer, weights_only=False)
        for other in (copied, loaded):
            assert differing(other, ref) == []
            assert not other._forward_pre_hooks
            assert not any("forward" in vars(m) for m in other.modules())
        assert all(torch.equal(loaded_state[n], t) for n, t in ref.state_dict().items())
        # a copy trains on its own: the placed original is not touched
        copied_opt = torch.optim.AdamW(copied.parameters(), lr=1e-3)
        seeded_step(copied, copied_opt, data[7], 7)
        assert differing(model, ref) == []
        # load other values into the placed parameters (both sides), then train on
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(0.5)
        model.load_state_dict(ref.state_dict())
        for k in range(3, 6):
            assert seeded_step(model, opt, data[k], k) == seeded_step(ref, ref_opt, data[k], k)
            assert differing(model, ref) == [], f"step {k + 1}"
        assert fit.decision is not None and fit.decision.chosen.base.placed_bytes > 0
        assert placer.placed
    finally:
        fit.remove()
    assert differing(model, ref) == []


@pytest.mark.parametrize("fails", ["a region's write", "the files' creation"])
def test_a_failed_write_keeps_the_parameters(
    budgets: tuple[int, int], monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    placed_least, unplaced_least = budgets

    class Full(paramplace.DiskTier):
        def __init__(self, directory: str | None) -> None:
            if fails == "the files' creation":  # a full disk before any region is written
                raise ResidencyError("tensorscope.residency: no space left on device (a test)")
            super().__init__(directory)

        def store(self, address: int, nbytes: int) -> Any:
            raise ResidencyError("tensorscope.residency: no space left on device (a test)")

    monkeypatch.setattr(place, "measure_mapping", lambda: 1e9)  # measured before the disk fills
    monkeypatch.setattr(paramplace, "DiskTier", Full)  # the placer's files only
    model = least_gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=(placed_least + unplaced_least) // 2)
    try:
        ids = least_batches(1)[0]
        with pytest.warns(FitWarning, match="stays in memory"), pytest.raises(ScheduleError):
            seeded_step(model, opt, ids, 0)
        seeded_step(ref, ref_opt, ids, 0)
        assert differing(model, ref) == []  # the step itself ran; nothing lost
        assert "writing parameters to the disk tier failed" in fit._place.off
        assert fit.decision is None and "no plan: " in fit.explain()
    finally:
        fit.remove()
    assert differing(model, ref) == []


def test_only_parameters_one_block_holds_alone_are_placed() -> None:
    blocks = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(3))
    head = torch.nn.Linear(256, 256, bias=False)
    head.weight = blocks[1].weight  # tied: the head reads it outside the chain
    model = torch.nn.ModuleDict({"blocks": blocks, "head": head})
    placed = paramplace.placeable(model, list(blocks))
    assert [[p is b.weight for p in ps] for ps, b in zip(placed, blocks, strict=True)] == [
        [True],  # the 1 KiB biases stay: below MIN_PLACED_BYTES
        [],
        [True],
    ]
    placer = paramplace.ParamPlacer(placed)
    before = blocks[0].weight.detach().clone()
    placer.place()
    try:
        assert placer.placed_nbytes == 2 * 256 * 256 * 4
        placer.use(0)
        assert placer.resident == 256 * 256 * 4
        placer.done(0)
        assert placer.resident == 0 and torch.equal(blocks[0].weight, before)
        with torch.no_grad():
            blocks[0].weight.add_(1.0)  # written through the mapping
    finally:
        placer.restore()
    assert torch.equal(blocks[0].weight, before + 1.0) and not placer.placed
