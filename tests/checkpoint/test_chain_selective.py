"""Blocks run as Fs (NOTE [selective recomputation]): their expensive ops' results kept, the rest
replayed in backward -- bit-identical to plain, measured, chosen by the DP where it pays (the
``free_replays`` fixture, tests/conftest.py, makes it pay whatever the machine's timings)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from chain_helpers import hf_step, same_state, tiny_hf, twins
from torch import nn

from tensorscope.checkpoint import checkpoint_chain, min_memory, solve, store_all_memory
from tensorscope.checkpoint.selective import Keep, Replay, kept

pytestmark = pytest.mark.engine_independent  # rotor runs plain torch ops


def _limit_with_fs(chained: Any) -> int:
    """A limit whose schedule runs some block as Fs (the lowest such, scanning up)."""
    chain = chained.chain()
    least, top = min_memory(chain), store_all_memory(chain)
    for k in range(41):
        limit = least + (top - least) * k // 40
        if any(op[0] == "Fs" for op in solve(chain, limit, slots=chained.slots).ops):
            return limit
    raise AssertionError("no limit between the least and store-all runs a block as Fs")


@pytest.mark.usefixtures("free_replays")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_selective_blocks_train_bit_identical_to_plain(name: str) -> None:
    model, ref = twins(tiny_hf(name))
    with checkpoint_chain(model) as chained:
        assert torch.equal(hf_step(model), hf_step(ref))  # measuring step
        assert chained.profile is not None
        for layer in chained.profile.layers:  # matmuls and dropout masks: kept by Fs
            assert layer.sel_nbytes > 0
            assert layer.x_nbytes + layer.sel_nbytes < layer.xbar_nbytes
            assert 0 < layer.sel_share < 1
        limit = _limit_with_fs(chained)
        chained.compute_sequence(limit + chained.reserved_nbytes)
        assert "kept selectively" in chained.explain()
        for _ in range(3):  # the first re-times (the replays too) and solves again
            model.zero_grad()
            ref.zero_grad()
            assert torch.equal(hf_step(model), hf_step(ref))  # dropout masks: kept, not drawn
            assert same_state(model, ref) == []


class _PathBlock(nn.Module):
    """A block whose forward takes another path with autograd on: an identity product (exact),
    so the replay meets an op the kept results do not have."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.3)
        self.grad_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        if torch.is_grad_enabled():
            self.grad_calls += 1
            h = h @ torch.eye(h.shape[-1])
        return x + self.drop(self.down(h))


class _PathChain(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_PathBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.usefixtures("free_replays")
def test_a_replay_that_meets_another_path_recomputes_the_block_whole() -> None:
    model, ref = twins(_PathChain())
    x = torch.randn(256, 64)
    blocks = [b for b in model.layers if isinstance(b, _PathBlock)]

    def step(m: nn.Module) -> torch.Tensor:
        torch.manual_seed(1)
        m.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss.detach()

    with checkpoint_chain(model) as chained:
        assert torch.equal(step(model), step(ref))
        chained.compute_sequence(_limit_with_fs(chained) + chained.reserved_nbytes)
        for k in range(2):  # the second runs what the re-timed chain solved: Fs or not
            assert chained.schedule is not None
            fs = {op[1] for op in chained.schedule.ops if op[0] == "Fs"}
            assert fs or k > 0
            before = [b.grad_calls for b in blocks]
            assert torch.equal(step(model), step(ref))
            assert same_state(model, ref) == []
            for k in fs:  # the replay began with autograd, diverged, and the block ran again
                assert blocks[k].grad_calls - before[k] == 2


def test_keep_and_replay_answer_the_kept_ops_in_order() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    with torch.no_grad(), Keep() as keep:
        y = nn.functional.dropout(lin(x), 0.5)
    assert [sig[0].overloadpacket for sig, _ in keep.results] == [
        torch.ops.aten.addmm,
        torch.ops.aten.bernoulli_,
    ]
    assert keep.nbytes() == 2 * 4 * 8 * 4
    torch.manual_seed(5)  # another random state: the mask comes from the kept draw
    with Replay(keep.results) as replay:
        z = nn.functional.dropout(lin(x), 0.5)
        replay.finish()
    assert torch.equal(y, z)
    assert z.requires_grad
    assert all(value is None for _, value in keep.results)  # given up to the replay's graph
    assert kept(torch.ops.aten.mm.default) and not kept(torch.ops.aten.tanh.default)
