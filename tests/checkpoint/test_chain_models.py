"""Block chains of real models: results and gradients equal plain, memory within the limit.

Rotor runs plain torch ops: these tests never reach a scope engine (checked), so they run once;
a chain trained inside scopes is tested in test_chain_in_scopes.py, under both engines.
"""

from __future__ import annotations

import copy
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from chain_helpers import (
    Block,
    ChainMeter,
    MLPChain,
    hf_step,
    metered,
    mlp_step,
    same_state,
    tiny_hf,
    twins,
)
from torch import nn

from tensorscope.checkpoint import (
    Checkpointable,
    Op,
    checkpoint_chain,
    min_memory,
    solve,
    store_all_memory,
)
from tensorscope.checkpoint.blockprobe import every_block_ops
from tensorscope.checkpoint.solver import store_all_ops
from tensorscope.errors import ArgumentTypeError

pytestmark = pytest.mark.engine_independent

MODELS = ["gpt2", "llama", "bert", "mlp"]


def make(name: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    if name == "mlp":
        torch.manual_seed(0)
        return MLPChain(), mlp_step
    return tiny_hf(name), hf_step


@contextmanager
def counting_runs(blocks: tuple[nn.Module, ...]) -> Iterator[Counter[int]]:
    """How many times each block really runs: a pre-hook on its first submodule, which its
    forward calls once (GPT2Block.ln_1, LlamaDecoderLayer.self_attn, BertLayer.attention)."""
    runs: Counter[int] = Counter()
    hooks = [
        next(block.children()).register_forward_pre_hook(lambda *_, k=k: runs.update([k]))
        for k, block in enumerate(blocks)
    ]
    try:
        yield runs
    finally:
        for h in hooks:
            h.remove()


def forward_runs(ops: tuple[Op, ...]) -> Counter[int]:
    """Calls of each block's modules: an Fs runs the block, and its B replays it."""
    runs = Counter(op[1] for op in ops if op[0] in ("Fn", "Fck", "Fe", "Fs"))  # type: ignore[misc]
    runs.update(op[1] for op in ops if op[0] == "Fs")  # type: ignore[misc]
    return runs


@pytest.mark.parametrize("name", MODELS)
def test_losses_gradients_and_buffers_equal_plain_at_every_limit(name: str) -> None:
    model, step = make(name)
    model, ref = twins(model)
    with checkpoint_chain(model) as chained:
        # step 1: every block checkpointed while measuring
        assert torch.equal(step(model), step(ref))
        assert same_state(model, ref) == []
        chain = chained.chain()
        least, top = min_memory(chain), store_all_memory(chain)
        n = len(chained.blocks)
        if name != "mlp":  # dropout in every transformers block: recomputing replays RNG
            assert chained.profile is not None
            assert all(p.uses_rng for p in chained.profile.layers)
        seen = {}
        for limit in (least, (least + top) // 2, top):
            chained.compute_sequence(limit + chained.reserved_nbytes)
            assert chained.schedule is not None
            for _ in range(2):  # the first scheduled step re-times the blocks and re-solves
                model.zero_grad()
                ref.zero_grad()
                with counting_runs(chained.blocks) as runs:
                    assert torch.equal(step(model), step(ref))  # dropout masks replayed
                assert same_state(model, ref) == []  # every parameter, chain or not; buffers
            ops = chained.schedule.ops
            # the blocks ran as the schedule says, and the schedule is rotor's DP's
            assert runs == forward_runs(ops)
            if limit < top:
                assert ops == solve(chained.chain(), limit, slots=chained.slots).ops
            seen[limit] = ops
        after = torch.rand(3)
    torch.manual_seed(3)  # the global random stream is the plain model's
    model.zero_grad()
    assert torch.equal(step(model), step(ref))
    assert len(set(seen.values())) == 3
    mid = seen[(least + top) // 2]
    assert mid != tuple(every_block_ops(n)) and mid != tuple(store_all_ops(0, n, n))
    # between the extremes some blocks are recomputed and some are not (not "every block")
    assert set(forward_runs(mid).values()) >= {1, 2}
    assert seen[top] == tuple(store_all_ops(0, n, n))  # nothing recomputed when all fits
    assert after.shape == (3,)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_without_rng_replay_recomputed_dropout_changes_the_gradients(name: str) -> None:
    """The control for the test above: the blocks' dropout is live in the recomputations, so
    equal gradients there come from replaying the random state."""
    model, ref = twins(tiny_hf(name))
    with checkpoint_chain(model, preserve_rng_state=False) as chained:
        hf_step(model)
        hf_step(ref)
        chained.compute_sequence(min_memory(chained.chain()) + chained.reserved_nbytes)
        model.zero_grad()
        ref.zero_grad()
        assert torch.equal(hf_step(model), hf_step(ref))  # the forward is the plain one
        assert same_state(model, ref) != []  # recomputed blocks drew other masks


@pytest.mark.parametrize("name", MODELS)
def test_measured_chain_memory_stays_within_the_limit(name: str) -> None:
    model, step = make(name)
    model.train()
    with checkpoint_chain(model) as chained:
        step(model)
        chain = chained.chain()
        least, top = min_memory(chain), store_all_memory(chain)
        for limit in (least, (least + top) // 2):
            limit += chained.reserved_nbytes
            chained.compute_sequence(limit)
            for _ in range(2):
                model.zero_grad()
                meter = ChainMeter()
                with metered(meter):
                    step(model)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            # what the chain holds that it did not allocate: its input, the shared context,
            # and (conservatively) the chain output's gradient
            held = chain.x_sizes[0] + chained.context_nbytes + chain.x_sizes[-1]
            measured = meter.chain_peak(grads) + held
            assert chained.schedule is not None
            predicted = chained.schedule.peak + chained.reserved_nbytes
            assert measured <= predicted <= limit
            assert measured >= 0.6 * predicted  # the model is close, not vacuous


def test_context_that_requires_grad_and_extra_outputs() -> None:
    torch.manual_seed(0)
    model, ref = twins(MLPChain(use_extras=True))
    bias = torch.randn(32, requires_grad=True)  # like a decoder's encoder states
    model.bias = ref.bias = bias
    with checkpoint_chain(model) as chained:
        assert torch.equal(mlp_step(model), mlp_step(ref))
        chained.compute_sequence(min_memory(chained.chain()) + chained.reserved_nbytes)
        for _ in range(2):
            model.zero_grad()
            ref.zero_grad()
            bias.grad = None
            loss = mlp_step(model)
            got = bias.grad.clone()  # type: ignore[union-attr]
            bias.grad = None
            assert torch.equal(loss, mlp_step(ref))
            assert torch.equal(got, bias.grad)  # type: ignore[arg-type]
            assert same_state(model, ref) == []


def test_autocast_recomputations_match_plain() -> None:
    torch.manual_seed(0)
    model, ref = twins(MLPChain())
    x = torch.randn(64, 32)

    def step(m: nn.Module) -> torch.Tensor:
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        out.float().pow(2).mean().backward()
        return out.detach()

    with checkpoint_chain(model) as chained:
        assert torch.equal(step(model), step(ref))
        chained.compute_sequence(min_memory(chained.chain()) + chained.reserved_nbytes)
        for _ in range(2):
            model.zero_grad()
            ref.zero_grad()
            out = step(model)
            assert out.dtype == torch.bfloat16
            assert torch.equal(out, step(ref))
            assert same_state(model, ref) == []


def test_eval_no_grad_and_frozen_steps_run_the_blocks_unchanged() -> None:
    torch.manual_seed(0)
    model = MLPChain()
    x = torch.randn(8, 32)
    with checkpoint_chain(model, mem_limit="1MiB") as chained:
        model.eval()
        model(x)
        model.train()
        with torch.no_grad():
            model(x)
        for p in model.parameters():
            p.requires_grad_(False)
        model(x)
        assert chained.profile is None  # nothing was measured: no training step ran
        for p in model.parameters():
            p.requires_grad_(True)
        mlp_step(model, x)
        assert chained.profile is not None


def test_install_changes_nothing_else_and_remove_restores() -> None:
    model = tiny_hf("gpt2")
    keys = list(model.state_dict())
    modules = [name for name, _ in model.named_modules()]
    block = model.transformer.h[0]
    with checkpoint_chain(model, mem_limit="64MiB") as chained:
        assert chained.path == "transformer.h"
        assert list(model.state_dict()) == keys
        assert [name for name, _ in model.named_modules()] == modules
        assert "forward" in block.__dict__
        hf_step(model)
    assert chained.removed and "forward" not in block.__dict__
    chained.remove()  # idempotent
    assert (
        repr(chained) == "CheckpointedChain(transformer.h: 4 blocks, mem_limit=64.0 MiB, removed)"
    )


def test_a_larger_batch_is_measured_again() -> None:
    torch.manual_seed(0)
    model = MLPChain()
    model.train()
    with checkpoint_chain(model) as chained:
        mlp_step(model, torch.randn(16, 32))
        assert chained.profile is not None and chained.profile.input_nbytes == 16 * 32 * 4
        mlp_step(model, torch.randn(8, 32))  # smaller: the schedule is reused
        assert chained.profile.input_nbytes == 16 * 32 * 4
        mlp_step(model, torch.randn(64, 32))  # larger: measured again
        assert chained.profile.input_nbytes == 64 * 32 * 4


class Recording(Block):
    """Keeps a weak reference to the second output of each of its runs."""

    made: list[weakref.ref[torch.Tensor]] = []

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = super().forward(*args, **kwargs)
        Recording.made.append(weakref.ref(out[1]))
        return out


def test_block_outputs_the_model_drops_are_not_kept_alive() -> None:
    torch.manual_seed(0)
    model = MLPChain()
    model.layers = nn.ModuleList(Recording(32) for _ in range(6))
    model.train()
    x = torch.randn(64, 32)
    with checkpoint_chain(model) as chained:
        mlp_step(model, x)
        chained.compute_sequence(min_memory(chained.chain()) + chained.reserved_nbytes)
        for _ in range(2):
            Recording.made.clear()
            torch.manual_seed(3)
            loss = model(x).pow(2).mean()
            # the model summed each block's second output and let it go: so does the chain
            assert len(Recording.made) == 6
            assert [r() for r in Recording.made] == [None] * 6
            loss.backward()
            assert all(r() is None for r in Recording.made)  # recomputations' too


def test_a_llama_layer_list_passed_directly() -> None:
    """checkpoint_chain(model.model.layers, mem_limit=...): the documented equivalent of
    Checkpointable(model.model.layers, ...), which says so."""
    model, ref = twins(tiny_hf("llama"))
    layers = model.model.layers
    with pytest.raises(ArgumentTypeError, match=r"checkpoint_chain\(model\.model\.layers"):
        Checkpointable(layers, mem_limit="1MiB")
    sizer = copy.deepcopy(model)  # learn this chain's least and store-all memory
    with checkpoint_chain(sizer.model.layers) as probe:
        hf_step(sizer)
        chain, reserved = probe.chain(), probe.reserved_nbytes
    n = len(layers)
    limit = (min_memory(chain) + store_all_memory(chain)) // 2 + reserved
    with checkpoint_chain(layers, mem_limit=limit) as chained:
        assert chained.path == "" and chained.blocks == tuple(layers)
        for _ in range(3):  # measure, re-time, then the schedule as solved
            model.zero_grad()
            ref.zero_grad()
            assert torch.equal(hf_step(model), hf_step(ref))
            assert same_state(model, ref) == []
        assert chained.schedule is not None
        assert chained.schedule.peak + chained.reserved_nbytes <= limit
        ops = chained.schedule.ops
        assert ops not in (tuple(every_block_ops(n)), tuple(store_all_ops(0, n, n)))
        assert "LlamaDecoderLayer" in chained.explain()
    assert "forward" not in layers[0].__dict__
