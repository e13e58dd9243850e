"""The decision on plain data (no tensors): fit's account of a step and its choice."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorscope.checkpoint import Chain, min_memory, store_all_memory
from tensorscope.errors import ScheduleError
from tensorscope.fit.account import StepBase
from tensorscope.fit.decide import decide

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)

CHAIN = Chain([1.0] * 6, [2.0] * 6, [10] * 7, [0] + [50] * 6, [5] * 6, [8] * 6)
KEPT = StepBase(False, 500, 700, 800, 300, 150, 100, 1.0)
FREED = StepBase(True, 380, 580, 420, 300, 30, 100, 1.0)


def test_gradients_freed_win_when_allowed() -> None:
    top = store_all_memory(CHAIN)
    d = decide(KEPT.under_chain + top + 200, [KEPT, FREED], CHAIN)
    assert d.free_gradients
    assert set(d.blocks) == {"keep"}
    assert d.chosen.predicted_s == pytest.approx(1.0 + 18.0)


def test_without_the_freed_candidate_the_kept_one_is_used() -> None:
    d = decide(1400, [KEPT], CHAIN)
    assert not d.free_gradients
    assert d.chosen.predicted_peak <= 1400


def test_no_fit_names_the_smallest_budget_and_it_fits() -> None:
    with pytest.raises(ScheduleError, match="smallest budget that fits") as info:
        decide(100, [KEPT, FREED], CHAIN)
    least = int(re.findall(r"\((\d+) bytes\)", str(info.value))[1])
    assert least == max(
        FREED.outside,
        FREED.under_chain
        + min_memory(
            CHAIN.__class__(
                CHAIN.fw,
                CHAIN.bw,
                CHAIN.x_sizes,
                CHAIN.xbar_sizes,
                CHAIN.fw_tmp,
                CHAIN.bw_tmp,
                FREED.loss_tmp,
            )
        ),
    )
    d = decide(least, [KEPT, FREED], CHAIN, slots=10_000)
    assert d.chosen.predicted_peak <= least
    with pytest.raises(ScheduleError):
        decide(least - 1, [KEPT, FREED], CHAIN)


def test_no_chain_decides_gradients_only() -> None:
    d = decide(900, [KEPT, FREED])
    assert d.free_gradients and d.blocks == ()
    assert d.chosen.predicted_peak == max(FREED.outside, FREED.under_chain, FREED.at_loss)


def test_reserve_comes_off_the_chain() -> None:
    budget = 1000
    plain = decide(budget, [FREED], CHAIN)
    reserved = decide(budget, [FREED], CHAIN, reserve=100)
    assert reserved.chosen.predicted_s >= plain.chosen.predicted_s
    assert reserved.chosen.predicted_peak <= budget


@settings(max_examples=40, deadline=None)
@given(st.integers(min_value=0, max_value=600))
def test_more_budget_never_predicts_a_slower_step(extra: int) -> None:
    least = 700
    a = decide(least + extra, [FREED], CHAIN, slots=10_000)
    b = decide(least + extra + 50, [FREED], CHAIN, slots=10_000)
    assert b.chosen.predicted_s <= a.chosen.predicted_s + 1e-9
    assert a.chosen.predicted_peak <= least + extra


def test_offloaded_state_is_chosen_only_when_it_is_needed_or_faster() -> None:
    # one step with its optimizer state resident, and the same with the state in the next
    # tier: 100 bytes less under the chain and at the loss, 0.5 s of transfers
    resident = StepBase(False, 500, 700, 520, 300, 150, 100, 1.0)
    moved = StepBase(False, 400, 600, 520, 300, 150, 100, 1.5, True, 100)
    roomy = decide(resident.under_chain + store_all_memory(CHAIN) + 200, [resident, moved], CHAIN)
    assert not roomy.chosen.base.state_offloaded  # the resident state fits: no transfers
    least = decide(10_000, [resident], CHAIN).least_budget
    assert least > resident.outside  # the chain's region sets it, where the state is moved
    tight = decide(least - 50, [resident, moved], CHAIN)
    assert tight.chosen.base.state_offloaded
    assert tight.chosen.predicted_peak <= least - 50
    assert [c.fits for c in tight.candidates] == [False, True]
