"""Block chains of real models: results and gradients equal plain, memory within the limit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from chain_helpers import (
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

from tensorscope.checkpoint import checkpoint_chain, min_memory, store_all_memory
from tensorscope.checkpoint.blockprobe import every_block_ops
from tensorscope.checkpoint.solver import store_all_ops

MODELS = ["gpt2", "llama", "bert", "mlp"]


def make(name: str) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    if name == "mlp":
        torch.manual_seed(0)
        return MLPChain(), mlp_step
    return tiny_hf(name), hf_step


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
        seen = set()
        for limit in (least, (least + top) // 2, top):
            chained.compute_sequence(limit + chained.reserved_nbytes)
            assert chained.schedule is not None
            seen.add(chained.schedule.ops)
            for _ in range(2):  # the first scheduled step re-times the blocks and re-solves
                model.zero_grad()
                ref.zero_grad()
                assert torch.equal(step(model), step(ref))  # dropout masks replayed
                assert same_state(model, ref) == []  # every parameter, chain or not; buffers
        after = torch.rand(3)
    torch.manual_seed(3)  # the global random stream is the plain model's
    model.zero_grad()
    assert torch.equal(step(model), step(ref))
    assert len(seen) == 3
    mid = sorted(seen, key=len)[1]
    assert mid != tuple(every_block_ops(n)) and mid != tuple(store_all_ops(0, n, n))
    assert after.shape == (3,)


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


def test_training_in_scopes_with_adamw_ends_with_the_plain_weights() -> None:
    import tensorscope as ts

    model, ref = twins(tiny_hf("gpt2"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with checkpoint_chain(model) as chained:
        for i in range(3):
            expected = hf_step(ref)
            opt_ref.step()
            opt_ref.zero_grad()
            with ts.scope():
                assert torch.equal(hf_step(model), expected)
                opt.step()
                opt.zero_grad()
            if i == 0:
                chained.compute_sequence(min_memory(chained.chain()) + chained.reserved_nbytes)
    assert ts.stats().live == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
