"""The simulator: exact peaks by hand, and invalid schedules rejected with a reason."""

from __future__ import annotations

import pytest

from tensorscope.checkpoint import Chain, simulate
from tensorscope.checkpoint.chain import Op, format_ops
from tensorscope.checkpoint.simulate import Simulator
from tensorscope.errors import InvalidArgumentError

pytestmark = pytest.mark.engine_independent  # rotor runs plain torch ops (checked)

# x: input 4, outputs 2 and 3; xbar: 5 and 7; transients make each op's peak distinct
CHAIN = Chain([1, 10], [100, 1000], [4, 2, 3], [0, 5, 7], [1, 2], [3, 4], loss_tmp=6)


def test_peaks_by_hand() -> None:
    ops: list[Op] = [("Fck", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fe", 0), ("B", 0)]
    sim = simulate(CHAIN, ops)
    # Fck0: x0 4 + x1 2 + tmp 1 = 7 -> alive 6
    # Fe1: 6 + xbar2 7 + tmp 2 = 15 -> alive 13
    # Loss: 13 + d2 3 + tmp 6 = 22 -> alive 16 (x2 lives inside xbar2)
    # B1: 16 + d1 2 + tmp 4 = 22 -> frees xbar2, plain x1; d2 stays (autograd holds it): 4+3+2
    # Fe0: 9 + xbar1 5 + tmp 1 = 15 -> alive 14
    # B0: 14 + d0 4 + tmp 3 = 21
    assert sim.op_peaks == (7, 15, 22, 22, 15, 21)
    assert sim.peak == 22
    assert sim.time == 1 + 10 + 1000 + 1 + 100


def test_fn_drops_its_input_but_not_one_autograd_holds() -> None:
    sim = Simulator(CHAIN)
    sim.step(("Fck", 0))
    assert sim.alive == {("x", 0): 4, ("x", 1): 2}
    sim.step(("Fn", 1))
    assert sim.alive == {("x", 0): 4, ("x", 2): 3}
    sim = Simulator(CHAIN)
    sim.step(("Fe", 0))
    sim.step(("Fn", 1))  # x1 is the output inside xbar1: it stays
    assert sim.alive == {("x", 0): 4, ("saved", 1): 3, ("out", 1): 2, ("x", 2): 3}


@pytest.mark.parametrize(
    ("ops", "match"),
    [
        ([("Fe", 1)], "needs x_1, which is not alive"),
        ([("Fn", 0)], "would drop the chain input"),
        ([("Fck", 0), ("Fck", 0)], "computes x_1, which is already alive"),
        ([("Fck", 0), ("Fe", 1), ("Loss",), ("Loss",)], "runs the loss a second time"),
        ([("Fck", 0), ("Fck", 1), ("Loss",), ("B", 1)], "autograd state of layer 1"),
        ([("Fe", 0), ("B", 0)], "needs the gradient d_1"),
        ([("Fe", 0), ("Fe", 1), ("Loss",), ("B", 1), ("B", 0), ("Fe", 0)], "after its backward"),
        ([("X", 0)], "is not one of"),
        ([("Fe", 2)], "names layer 2"),
        ([("Fe", 0), ("Fe", 1), ("Loss",)], "ends before B\\(0\\)"),
    ],
)
def test_invalid_schedules_are_rejected(ops: list[Op], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        simulate(CHAIN, ops)


def test_persistent_mode_keeps_checkpoints_until_their_backward() -> None:
    chain = Chain([1, 1, 1], [1, 1, 1], [1, 1, 1, 1], [0, 2, 2, 2], [0, 0, 0], [0, 0, 0])
    ops: list[Op] = [("Fck", 0), ("Fck", 1), ("Fn", 2), ("Fn", 1)]
    sim = Simulator(chain, persistent=True)
    for op in ops[:3]:
        sim.step(op)  # x1 is now a checkpoint: Fck1 read it and kept it
    with pytest.raises(InvalidArgumentError, match="drops checkpoint x_1"):
        sim.step(ops[3])
    free = Simulator(chain)
    for op in ops:
        free.step(op)
    assert free.alive == {("x", 0): 1, ("x", 2): 1, ("x", 3): 1}
    assert format_ops(ops) == "Fck0 Fck1 Fn2 Fn1"
