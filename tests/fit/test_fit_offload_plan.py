"""Activation offload as one of ts.fit's choices: the decision on plain data, then a real step.

The decision (fit/decide.py with checkpoint/offloaded.py) on numbers; the runtime (a chain
block's saved tensors through the offloader) on a real MLP whose blocks save megabytes, with
the choice forced where the test is about what runs rather than what is chosen.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tensorscope as ts
from tensorscope.checkpoint import Chain
from tensorscope.checkpoint.offloaded import (
    OffloadModel,
    offload_window,
    offloaded_chain,
)
from tensorscope.checkpoint.simulate import simulate
from tensorscope.fit import handle
from tensorscope.fit.account import StepBase
from tensorscope.fit.decide import decide

from .fit_helpers import MLPChain, differing, offload_for_free, twin

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)

CHAIN = Chain([1.0] * 6, [2.0] * 6, [10] * 7, [0] + [50] * 6, [5] * 6, [8] * 6)
FREED = StepBase(True, 380, 580, 420, 300, 30, 100, 1.0)


def _recompute_budget() -> int:
    """A budget at which, without offload, rotor recomputes some blocks."""
    return FREED.under_chain + 380


def test_offload_cheaper_than_recompute_is_chosen_and_fits() -> None:
    budget = _recompute_budget()
    without = decide(budget, [FREED], CHAIN)
    assert "recompute" in without.blocks
    cheap = OffloadModel((40,) * 6, (0.05,) * 6)
    moved = decide(budget, [FREED], CHAIN, offload=cheap)
    assert "offload" in moved.blocks and "recompute" not in moved.blocks
    assert moved.chosen.predicted_s < without.chosen.predicted_s
    assert moved.chosen.predicted_peak <= budget
    offloaded = moved.chosen.offloaded
    assert list(offloaded) == [k for k, c in enumerate(moved.blocks) if c == "offload"]
    # the schedule fits the chain as offload leaves it, with the window set aside
    chain = offloaded_chain(
        Chain(*_fields(CHAIN), FREED.loss_tmp, keeps_output=CHAIN.keeps_output), cheap, offloaded
    )
    schedule = moved.chosen.schedule
    assert schedule is not None
    peak = simulate(chain, schedule.ops).peak
    assert FREED.under_chain + peak + offload_window(cheap, offloaded) <= budget
    assert moved.chosen.offload_nbytes == 40 * len(offloaded)


def _fields(chain: Chain) -> tuple[object, ...]:
    return (chain.fw, chain.bw, chain.x_sizes, chain.xbar_sizes, chain.fw_tmp, chain.bw_tmp)


def test_offload_slower_than_recompute_is_not_chosen() -> None:
    budget = _recompute_budget()
    without = decide(budget, [FREED], CHAIN)
    slow = OffloadModel((40,) * 6, (5.0,) * 6)  # moving a block takes 5x its forward
    d = decide(budget, [FREED], CHAIN, offload=slow)
    assert d.blocks == without.blocks and d.chosen.offloaded == ()
    assert d.chosen.predicted_s == without.chosen.predicted_s


def test_window_counts_a_block_and_the_one_before_it() -> None:
    model = OffloadModel((30, 40, 5, 0), (0.0,) * 4)
    assert offload_window(model, []) == 0
    assert offload_window(model, [0, 1, 2]) == 70
    assert offload_window(model, [2]) == 40  # the in-flight bound: the largest block
    shrunk = offloaded_chain(CHAIN, OffloadModel((45,) * 6, (0.0,) * 6), [1])
    assert shrunk.xbar_sizes[2] == 10 and shrunk.xbar_sizes[1] == 50  # never below x


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=2, max_size=7),
    st.lists(st.integers(0, 60), min_size=7, max_size=7),
    st.floats(0.0, 3.0),
    st.integers(0, 400),
)
def test_offload_never_predicts_worse_and_offloaded_blocks_run_once(
    saved: list[int], movable: list[int], io_s: float, extra: int
) -> None:
    n = len(saved)
    chain = Chain(
        [1.0] * n, [2.0] * n, [10] * (n + 1), [0] + [10 + s for s in saved], [3] * n, [4] * n
    )
    moved = tuple(min(m, s) for m, s in zip(movable[:n], saved, strict=True))
    model = OffloadModel(moved, (io_s,) * n)
    budget = FREED.under_chain + 60 + extra
    try:
        without = decide(budget, [FREED], chain, slots=10_000)
    except ts.ScheduleError:
        return
    d = decide(budget, [FREED], chain, slots=10_000, offload=model)
    assert d.chosen.predicted_s <= without.chosen.predicted_s + 1e-9
    assert d.chosen.predicted_peak <= budget
    assert d.least_budget <= without.least_budget
    schedule = d.chosen.schedule
    assert schedule is not None
    for k in d.chosen.offloaded:
        assert sum(1 for op in schedule.ops if op[0] != "B" and op[1:] == (k,)) == 1


# -- a real step ----------------------------------------------------------------------------

WIDTH, ROWS = 128, 2048  # each block saves 9 MiB of its own (two 4 MiB activations, a mask)


def _data() -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(ROWS, 16, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, seed: int) -> None:
    torch.manual_seed(seed)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _plain_peak() -> int:
    torch.manual_seed(0)
    model = MLPChain(WIDTH, 6).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _data()
    _step(model, opt, next(data), 0)
    with ts.record() as rec:
        _step(model, opt, next(data), 1)
    return rec.plan().peak_bytes


def _fitted_and_plain() -> tuple[
    int, nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, handle.Fit
]:
    """A budget of 60% of plain's step, the MLP fitted to it, and its plain twin."""
    budget = int(_plain_peak() * 0.6)
    torch.manual_seed(0)
    model = MLPChain(WIDTH, 6).train()
    plain = twin(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    return budget, model, plain, opt, plain_opt, ts.fit(model, opt, budget=budget)


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offload predicted free: the decision offloads wherever it fits (what runs is tested)."""
    offload_for_free(monkeypatch)


@pytest.mark.engine_dependent  # scopes or ts.manage
@pytest.mark.usefixtures("forced")
@pytest.mark.parametrize("scoped", [False, True])
def test_offloaded_blocks_train_bit_identically_within_the_budget(scoped: bool) -> None:
    budget, model, plain, opt, plain_opt, fit = _fitted_and_plain()
    try:
        data = _data()
        for i in range(5):
            x = next(data)
            with ts.scope() if scoped else contextlib.nullcontext():
                _step(model, opt, x, i)
            _step(plain, plain_opt, x, i)
            assert differing(model, plain) == [], f"step {i + 1}"
        decision = fit.decision
        assert decision is not None and "offload" in decision.blocks
        offloader = fit._offload.offloader
        assert offloader is not None
        stats = offloader.stats()
        chain = fit.chain
        assert chain is not None and chain.profile is not None
        for k in decision.chosen.offloaded:  # the probe measured what the offloader moves
            assert stats.groups[k].offloaded_bytes == chain.profile.layers[k].offload_nbytes > 0
        assert stats.bytes_written > 0 and stats.bytes_read > 0 and stats.write_errors == 0
        assert fit.plan_after is not None
        assert fit.measured_peak(fit.plan_after) <= budget
        text = fit.explain()
        assert f"offload: blocks 0-{decision.chosen.offloaded[-1]}" in text
    finally:
        fit.remove()
    assert offloader.closed


def test_measured_bandwidth_decides_and_explain_says_so() -> None:
    """Unforced: whichever way the measured times go, the plan fits and explain() says what
    was decided about offload."""
    budget = int(_plain_peak() * 0.6)
    torch.manual_seed(0)
    model = MLPChain(WIDTH, 6).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=budget)
    try:
        data = _data()
        for i in range(4):
            _step(model, opt, next(data), i)
        decision = fit.decision
        assert decision is not None and fit.plan_after is not None
        assert fit.measured_peak(fit.plan_after) <= budget
        text = fit.explain()
        if decision.chosen.offloaded:
            assert "offload: block" in text
        else:
            assert "offload: considered" in text
    finally:
        fit.remove()


def test_tiny_blocks_are_not_considered_for_offload() -> None:
    torch.manual_seed(0)
    model = MLPChain(16, 3).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fit = ts.fit(model, opt, budget="64MiB")
    try:
        data = _data()
        for i in range(3):
            _step(model, opt, next(data)[:64], i)
        assert "offload: not considered (no block saves tensors of 256.0 KiB" in fit.explain()
        assert fit._offload.offloader is None
    finally:
        fit.remove()


@pytest.mark.usefixtures("forced")
def test_a_failed_write_keeps_the_activation_and_warns() -> None:
    budget, model, plain, opt, plain_opt, fit = _fitted_and_plain()
    try:
        data = _data()
        x = next(data)
        _step(model, opt, x, 0)  # measured and decided: the offloader exists now
        _step(plain, plain_opt, x, 0)
        assert fit._offload.offloader is not None
        store = fit._offload.offloader._engine.store

        def full(*args: object) -> object:
            raise OSError(28, "No space left on device")

        store.finish = full  # type: ignore[method-assign]
        with pytest.warns(ts.FitWarning, match="could not be written .* deciding again"):
            for i in (1, 2):
                x = next(data)
                _step(model, opt, x, i)
                _step(plain, plain_opt, x, i)
        assert differing(model, plain) == []
        assert fit._offload.offloader.stats().write_errors > 0
        for i in range(3, 6):  # decided again without offload: still within the budget
            x = next(data)
            _step(model, opt, x, i)
            _step(plain, plain_opt, x, i)
        assert differing(model, plain) == []
        assert fit.decision is not None and "offload" not in fit.decision.blocks
        assert fit.plan_after is not None and fit.measured_peak(fit.plan_after) <= budget
        assert "offload: not considered (writing activations to the disk tier failed" in (
            fit.explain()
        )
    finally:
        fit.remove()


def test_a_step_slower_than_predicted_with_offload_retimes_the_offload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Offload predicted nearly free, measured slow (fit/handle.py, NOTE [a prediction measured
    against]): the error goes to the offload's writes and reads, and the decision taken again
    offloads nothing; training stays bit-identical throughout."""
    from tensorscope.fit import offload_store
    from tensorscope.fit.decider import Decider

    monkeypatch.setattr(handle, "TIME_TOLERANCE", 0.10)  # the root conftest turns it off
    measured = Decider.offload_model

    def cheap(self: Decider) -> OffloadModel | None:  # a bandwidth measured far too high
        model = measured(self)
        seconds = tuple(1e-6 * self.offload_scale for _ in model.nbytes) if model else ()
        return None if model is None else OffloadModel(model.nbytes, seconds)

    read = offload_store.DiskStore.read

    def slow_read(self: offload_store.DiskStore, copy: Any, nbytes: int) -> Any:
        time.sleep(0.05)  # the disk, slower than its bandwidth measured alone
        return read(self, copy, nbytes)

    monkeypatch.setattr(Decider, "offload_model", cheap)
    monkeypatch.setattr(offload_store.DiskStore, "read", slow_read)
    _budget, model, plain, opt, plain_opt, fit = _fitted_and_plain()
    try:
        data = _data()
        offloaded: tuple[int, ...] = ()
        for i in range(9):
            x = next(data)
            _step(model, opt, x, i)
            _step(plain, plain_opt, x, i)
            assert differing(model, plain) == [], f"step {i + 1}"
            if i == 2:
                assert fit.decision is not None
                offloaded = fit.decision.chosen.offloaded
        assert offloaded, "the cheap offload was chosen"
        notes = [n for n in fit.notes if "against the predicted" in n]
        assert len(notes) == 1 and "the offload's writes and reads re-timed" in notes[0], notes
        assert fit.decision is not None and not fit.decision.chosen.offloaded
    finally:
        fit.remove()
