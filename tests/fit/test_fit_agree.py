"""What ranks agree on before a distributed fit decides, on plain data (fit/agree.py): the merged
measurements give every rank one decision, and that decision fits the rank that needs most."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorscope.checkpoint import Chain
from tensorscope.checkpoint.offloaded import OffloadModel
from tensorscope.checkpoint.profile import LayerProfile, Profile
from tensorscope.checkpoint.simulate import simulate
from tensorscope.errors import InvalidArgumentError, ScheduleError
from tensorscope.fit.account import StepBase
from tensorscope.fit.agree import budget_note, common_bases, reasons_of, slowest
from tensorscope.fit.decide import decide

pytestmark = pytest.mark.engine_independent  # plain data


def _profile(fw: float, size: int, rng: bool = False, n: int = 4) -> Profile:
    layer = LayerProfile("Block", fw, 2 * fw, size, 4 * size, size, 2 * size, uses_rng=rng)
    return Profile(size, (layer,) * n, "cpu")


def test_the_slowest_profile_takes_every_largest_number_and_any_flag() -> None:
    merged = slowest([_profile(1.0, 100), _profile(1.5, 80, rng=True)])
    layer = merged.layers[0]
    assert (layer.fw_s, layer.bw_s, layer.x_nbytes, layer.xbar_nbytes) == (1.5, 3.0, 100, 400)
    assert layer.uses_rng and merged.input_nbytes == 100 and merged.device == "cpu"


def test_ranks_that_measured_different_chains_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="different lengths"):
        slowest([_profile(1.0, 100, n=4), _profile(1.0, 100, n=5)])
    other = dataclasses.replace(_profile(1.0, 100), device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="different things"):
        slowest([_profile(1.0, 100), other])


def test_a_missing_measurement_on_any_rank_is_missing_for_all() -> None:
    model = OffloadModel((10, 20), (0.1, 0.2))
    assert slowest([model, None]) is None
    assert slowest([model, OffloadModel((12, 18), (0.3, 0.1))]) == OffloadModel(
        (12, 20), (0.3, 0.2)
    )


KEPT = StepBase(False, 500, 700, 800, 300, 150, 100, 1.0)
FREED = StepBase(True, 380, 580, 420, 300, 30, 100, 1.0)
MOVED = dataclasses.replace(KEPT, under_chain=400, state_offloaded=True, offloaded_bytes=100)


def test_a_way_one_rank_cannot_take_is_taken_off_every_rank() -> None:
    # rank 1's disk tier failed: no candidate with the state moved; rank 2 reads gradients
    got = common_bases([[KEPT, FREED, MOVED], [KEPT, FREED], [KEPT, MOVED]])
    assert got == [KEPT]


def test_common_bases_keep_the_first_rank_order_and_the_largest_numbers() -> None:
    slow = dataclasses.replace(FREED, seconds=2.5, outside=900)
    got = common_bases([[FREED, KEPT], [KEPT, slow]])
    assert [b.free_gradients for b in got] == [True, False]
    assert got[0].seconds == 2.5 and got[0].outside == 900


def test_every_way_of_one_rank_is_kept_apart() -> None:
    # the same gradients and state, the LM loss in chunks or not: two ways, not one
    chunked = dataclasses.replace(KEPT, chunked_loss=True, at_loss=600, seconds=1.2)
    placed = dataclasses.replace(FREED, placed_bytes=64)
    ways = [KEPT, chunked, FREED, placed, MOVED]
    assert common_bases([ways]) == ways
    assert common_bases([ways, [chunked, KEPT]]) == [KEPT, chunked]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(300, 700),  # what the rank holds outside the chain
            st.floats(0.5, 3.0),  # a block's forward seconds there
            st.integers(30, 80),  # a block's saved bytes there
        ),
        min_size=2,
        max_size=4,
    ),
    st.integers(700, 2000),
)
def test_the_agreed_schedule_fits_every_rank_by_its_own_numbers(
    ranks: list[tuple[int, float, int]], budget: int
) -> None:
    """Whatever each rank measured, the schedule decided from the merged inputs, replayed on
    each rank's own chain, keeps that rank within the budget (NOTE [one decision across
    ranks]): the merge never under-counts a rank."""
    chains = [
        Chain([fw] * 6, [2 * fw] * 6, [10] * 7, [0] + [act] * 6, [5] * 6, [8] * 6)
        for _, fw, act in ranks
    ]
    bases = [[dataclasses.replace(KEPT, under_chain=u, at_loss=u, outside=u)] for u, _, _ in ranks]
    try:
        decision = decide(budget, common_bases(bases), slowest(chains))
    except ScheduleError:  # the merged numbers do not fit: every rank raises that
        return
    schedule = decision.chosen.schedule
    assert schedule is not None
    for (under, _, _), chain in zip(ranks, chains, strict=True):
        assert under + simulate(chain, schedule.ops).peak <= budget


def test_reasons_of_every_rank_once_each() -> None:
    assert reasons_of([["a", "b"], ["b", "a"]]) == ["a", "b"]
    assert reasons_of([["a"], [], ["a"]]) == ["a (on ranks 0, 2)"]


def test_different_budgets_are_said_once() -> None:
    assert budget_note([5, 5, 5], str) == ""
    assert "smallest, 3 (rank 2)" in budget_note([5, 4, 3], str)
