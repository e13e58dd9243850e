"""The dynamic program against the simulator and against brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from checkpoint_helpers import best_time, chains, least_memory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorscope.checkpoint import Chain, min_memory, simulate, solve, store_all_memory
from tensorscope.checkpoint.solver import store_all_ops
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError, ScheduleError

pytestmark = pytest.mark.engine_independent  # rotor runs plain torch ops (checked)

TWO = Chain([1, 1], [1, 1], [4, 4, 4], [0, 8, 8], [0, 0], [0, 0])


def _solve_or_inf(chain: Chain, limit: int) -> float:
    try:
        return solve(chain, limit).time
    except ScheduleError:
        return math.inf


def test_two_layer_chain_by_hand() -> None:
    # store-all: Fe0 (12) Fe1 (20) Loss (24) B1 (28) B0 -> peak 28, no recomputation
    assert store_all_memory(TWO) == 28
    assert solve(TWO, 28).ops == tuple(store_all_ops(0, 2, 2))
    # at 24, layer 0 is recomputed once (one extra fw[0])
    s = solve(TWO, 24)
    assert s.ops == (("Fck", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fe", 0), ("B", 0))
    assert (s.time, s.peak) == (5.0, 24)
    assert min_memory(TWO) == 24


def test_limit_below_minimum_says_the_smallest_that_fits() -> None:
    with pytest.raises(ScheduleError) as err:
        solve(TWO, 23)
    msg = str(err.value)
    assert msg.startswith("tensorscope.checkpoint:")
    assert "smallest limit that fits this 2-layer chain is 24 (24 B)" in msg
    assert "Raise mem_limit" in msg
    assert solve(TWO, 24).peak == 24


def test_store_all_limit_gives_plain_time() -> None:
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(1, 12)
        x = [rng.randint(1, 50) for _ in range(n + 1)]
        chain = Chain(
            [rng.random() for _ in range(n)],
            [rng.random() for _ in range(n)],
            x,
            [0] + [v + rng.randint(0, 50) for v in x[1:]],
            [rng.randint(0, 9) for _ in range(n)],
            [rng.randint(0, 9) for _ in range(n)],
        )
        top = store_all_memory(chain)
        s = solve(chain, top)
        assert s.time == pytest.approx(sum(chain.fw) + sum(chain.bw))
        assert s.peak == top == simulate(chain, s.ops).peak
        assert solve(chain, top - 1).time >= s.time if top - 1 >= min_memory(chain) else True


@pytest.mark.slow  # brute force over every schedule of 80 chains
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_dp_equals_brute_force_over_persistent_schedules(chain: Chain) -> None:
    least = min_memory(chain)
    assert least == least_memory(chain) == least_memory(chain, persistent=False)
    for limit in range(max(1, least - 1), store_all_memory(chain) + 1):
        dp = _solve_or_inf(chain, limit)
        assert dp == best_time(chain, limit), limit
        # schedules that drop a checkpoint before its backward can only be as good or better
        assert best_time(chain, limit, persistent=False) <= dp


@settings(max_examples=150, deadline=None)
@given(chains(max_layers=8, max_size=40), st.integers(0, 400))
def test_every_schedule_simulates_to_its_time_within_the_limit(chain: Chain, limit: int) -> None:
    limit = max(limit, 1)
    if limit < min_memory(chain):
        with pytest.raises(ScheduleError):
            solve(chain, limit)
        return
    s = solve(chain, limit)
    sim = simulate(chain, s.ops)
    assert sim.peak == s.peak <= limit
    assert sim.time == s.time  # integer times: the sums are exact


@settings(max_examples=40, deadline=None)
@given(chains(max_layers=6, max_size=15))
def test_time_never_increases_with_the_limit(chain: Chain) -> None:
    top = store_all_memory(chain)
    times = [solve(chain, m).time for m in range(max(1, min_memory(chain)), max(2, top + 1))]
    assert all(a >= b for a, b in itertools.pairwise(times))
    assert times[-1] == sum(chain.fw) + sum(chain.bw)


@settings(max_examples=50, deadline=None)
@given(chains(max_layers=10, max_size=2_000), st.integers(5, 60), st.floats(0, 1))
def test_slots_schedules_fit_the_real_limit(chain: Chain, slots: int, frac: float) -> None:
    least, top = min_memory(chain), store_all_memory(chain)
    limit = max(1, least + int(frac * (top - least)))
    s = solve(chain, limit, slots=slots)
    assert simulate(chain, s.ops).peak == s.peak <= limit
    assert s.time >= solve(chain, limit).time  # never better than exact


def test_deep_chain_with_500_slots() -> None:
    rng = random.Random(0)
    n = 50
    x = [rng.randint(1, 8) * 2**20 for _ in range(n + 1)]
    chain = Chain(
        [rng.uniform(1e-3, 5e-3) for _ in range(n)],
        [rng.uniform(2e-3, 9e-3) for _ in range(n)],
        x,
        [0] + [v * rng.randint(1, 3) for v in x[1:]],
        [rng.randint(0, 2**20) for _ in range(n)],
        [rng.randint(0, 2**20) for _ in range(n)],
    )
    least, top = min_memory(chain), store_all_memory(chain)
    previous = math.inf
    for frac in (0.1, 0.6):
        limit = int(least + frac * (top - least))
        s = solve(chain, limit, slots=500)
        assert simulate(chain, s.ops).peak == s.peak <= limit
        assert s.time <= previous
        previous = s.time


def test_rounding_to_slots_falls_back_to_the_least_memory_schedule() -> None:
    # one slot would be 24 / 2 = 12 units: every size rounds up to a whole slot and nothing fits
    s = solve(TWO, 24, slots=2)
    assert s.peak == 24 and s.time == 5.0


def test_exact_solve_refuses_a_huge_table() -> None:
    big = Chain([1] * 40, [1] * 40, [2**20] * 41, [0] + [2**21] * 40, [0] * 40, [0] * 40)
    with pytest.raises(InvalidArgumentError, match="slots=500"):
        solve(big, 30 * 2**20)
    assert solve(big, 30 * 2**20, slots=200).peak <= 30 * 2**20


def test_mem_limit_forms() -> None:
    assert solve(TWO, "1KiB").mem_limit == 1024
    with pytest.raises(InvalidArgumentError):
        solve(TWO, "lots")
    with pytest.raises(ArgumentTypeError):
        solve(TWO, 24.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        solve(TWO, 24, slots=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fw": []}, InvalidArgumentError, "at least one layer"),
        ({"bw": [1]}, InvalidArgumentError, "bw has 1 entries, expected 2"),
        ({"x_sizes": [4, 4]}, InvalidArgumentError, "x_sizes has 2 entries, expected 3"),
        ({"x_sizes": [4, 4.5, 4]}, ArgumentTypeError, r"x_sizes\[1\] must be an int"),
        ({"xbar_sizes": [0, 3, 8]}, InvalidArgumentError, "smaller than x_sizes"),
        ({"fw_tmp": [-1, 0]}, InvalidArgumentError, "must be >= 0"),
        ({"fw": [1, math.nan]}, InvalidArgumentError, "finite time"),
        ({"bw": "ab"}, ArgumentTypeError, "sequence"),
    ],
)
def test_chain_validation(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    args: dict[str, object] = {
        "fw": [1, 1],
        "bw": [1, 1],
        "x_sizes": [4, 4, 4],
        "xbar_sizes": [0, 8, 8],
        "fw_tmp": [0, 0],
        "bw_tmp": [0, 0],
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        Chain(**args)  # type: ignore[arg-type]


# Purity (no torch import) is checked for every pure module in tests/core/test_pure_modules.py.


def test_slots_round_to_nearest_then_check_the_real_limit() -> None:
    # sizes 701 with 60 slots: a slot is limit / 60 ~ 117-175, so rounding every size up
    # would lose up to a whole activation; rounding to nearest and checking does not here
    n = 12
    chain = Chain([1.0] * n, [2.0] * n, [701] * (n + 1), [0] + [701] * n, [0] * n, [0] * n)
    for limit in (7006, 8406, 9806, 10506):
        s = solve(chain, limit, slots=60)
        assert s.time == solve(chain, limit).time
        assert s.peak <= limit


def test_selective_forward_where_it_pays_by_hand() -> None:
    # layer 0 saves 8 beyond its output with Fe; Fs keeps 2 of them for 1 more second of
    # backward (the replay), and recomputing layer 0 would cost 3 (its forward)
    chain = Chain(
        [3, 1], [1, 1], [4, 4, 4], [0, 12, 8], [0, 0], [0, 0],
        xsel_sizes=[0, 6, 8], sel_bw=[1, 0], sel_bw_tmp=[10, 0],
    )  # fmt: skip
    top = store_all_memory(chain)
    assert solve(chain, top).ops == tuple(store_all_ops(0, 2, 2))  # room: plain Fe
    s = solve(chain, top - 4)
    assert s.ops == (("Fs", 0), ("Fe", 1), ("Loss",), ("B", 1), ("B", 0))
    assert s.time == 3 + 1 + 1 + 1 + 1 == simulate(chain, s.ops).time
    assert s.peak == simulate(chain, s.ops).peak <= top - 4
    assert s.time < solve(Chain([3, 1], [1, 1], [4, 4, 4], [0, 12, 8], [0, 0], [0, 0]), 28).time


def test_selective_schedules_equal_brute_force() -> None:
    # hypothesis draws few chains where Fs is the optimum: a seeded sweep that counts them
    rng = random.Random(7)
    used = 0
    for _ in range(60):
        n = rng.randint(1, 3)
        x = [rng.randint(1, 4) for _ in range(n + 1)]
        extra = [rng.randint(2, 8) for _ in range(n)]
        keep = [rng.randint(0, e - 1) for e in extra]
        chain = Chain(
            [rng.randint(2, 5) for _ in range(n)],
            [rng.randint(1, 3) for _ in range(n)],
            x,
            [0] + [x[k + 1] + extra[k] for k in range(n)],
            [rng.randint(0, 2) for _ in range(n)],
            [0] * n,
            rng.randint(0, 2),
            xsel_sizes=[0] + [x[k + 1] + keep[k] for k in range(n)],
            sel_bw=[rng.randint(0, 1) for _ in range(n)],
            sel_bw_tmp=[extra[k] - keep[k] + x[k + 1] for k in range(n)],
        )
        for limit in range(min_memory(chain), store_all_memory(chain) + 1):
            s = solve(chain, limit)
            assert s.time == best_time(chain, limit), (chain, limit)
            assert simulate(chain, s.ops).peak == s.peak <= limit
            used += any(op[0] == "Fs" for op in s.ops)
    assert used > 20  # the sweep does reach Fs
