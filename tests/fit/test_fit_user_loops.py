"""ts.fit under training loops as users write them (trust round 4): hooks users put on blocks,
a loop whose steps differ from the recorded one. Every case compares with the plain twin bit
for bit after every step."""

from __future__ import annotations

import copy

import pytest
import torch

import tensorscope as ts
from tensorscope.errors import FitWarning, InvalidArgumentError

from .fit_helpers import batches, differing, optimizer, step, tiny, twin


def test_full_backward_hook_on_a_block() -> None:
    """A full backward hook hands the block's forward a view of its input (an identity
    Function): still the chain, the hook sees plain's gradients."""
    model = tiny("gpt2")
    ref = twin(model)
    seen: list[float] = []
    theirs: list[float] = []
    for m, log in ((model, seen), (ref, theirs)):
        m.transformer.h[1].register_full_backward_hook(
            lambda mod, gin, gout, log=log: log.append(float(gout[0].norm()))
        )
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget="1GiB")
    mine, other = batches("gpt2"), batches("gpt2")
    for i in range(4):
        assert step(model, opt, next(mine), seed=i, scoped=True) == step(
            ref, ropt, next(other), seed=i
        )
        assert not differing(model, ref)
    assert seen == theirs and len(seen) == 4
    fit.remove()


def _plain_copy(
    model: torch.nn.Module, opt: torch.optim.Optimizer
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A plain model and optimizer equal to the fitted ones now (a deepcopy is plain)."""
    twin_model = copy.deepcopy(model)
    twin_opt = optimizer("adamw", twin_model)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return twin_model, twin_opt


def test_clipping_that_starts_after_the_recorded_step_is_said_and_then_exact() -> None:
    """NOTE [a step that reads gradients after the recorded one]: clip_grad_norm_ from step 4
    found the gradients applied inside backward already: a FitWarning says so at once, and from
    the next step on gradients are kept, every step as the plain loop's."""
    model = tiny("gpt2")
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget="1GiB")
    data = batches("gpt2")
    for i in range(3):
        step(model, opt, next(data), seed=i, scoped=True)
    assert fit.decision is not None and fit.decision.free_gradients
    with pytest.warns(FitWarning, match=r"clip_grad_norm_\(\).*nothing was clipped"):
        step(model, opt, next(data), seed=3, clip=1.0, scoped=True)
    assert fit.decision is not None and not fit.decision.free_gradients
    assert any("clip_grad_norm_" in r for r in fit.grads_kept_because)
    ref, ropt = _plain_copy(model, opt)
    for i in range(4, 7):
        batch = next(data)
        assert step(model, opt, batch, seed=i, clip=1.0, scoped=True) == step(
            ref, ropt, batch, seed=i, clip=1.0
        )
        assert not differing(model, ref)
    fit.remove()


def _accumulating_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    micro: list[dict[str, torch.Tensor]],
    seed: int,
) -> float:
    torch.manual_seed(seed)
    total = 0.0
    for batch in micro:
        with ts.scope():
            loss = model(**batch).loss / len(micro)
            loss.backward()
            total += float(loss.item())
    opt.step()
    opt.zero_grad()
    return total


def test_accumulation_that_starts_after_the_recorded_step_is_said_and_then_exact() -> None:
    model = tiny("gpt2")
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget="1GiB")
    data = batches("gpt2")
    for i in range(3):
        _accumulating_step(model, opt, [next(data)], i)
    assert fit.decision is not None and fit.decision.free_gradients
    with pytest.warns(FitWarning, match="a second forward before optimizer.step"):
        _accumulating_step(model, opt, [next(data), next(data)], 3)
    assert fit.decision is not None and not fit.decision.free_gradients
    ref, ropt = _plain_copy(model, opt)
    for i in range(4, 6):
        micro = [next(data), next(data)]
        assert _accumulating_step(model, opt, micro, i) == _accumulating_step(ref, ropt, micro, i)
        assert not differing(model, ref)
    fit.remove()


def test_a_second_backward_through_the_blocks_is_a_clear_error_and_loses_nothing() -> None:
    """retain_graph=True, then another backward through the same forward: the chain freed the
    blocks' activations; the error says what to do, and the next steps train as plain."""
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget="1GiB")
    mine, other = batches("gpt2"), batches("gpt2")
    try:
        out = model(**next(mine))
        next(other)  # the twin skips the failed step's batch
        out.loss.backward(retain_graph=True)
        with pytest.raises(InvalidArgumentError, match=r"\(loss \+ aux\)\.backward\(\)"):
            out.logits.float().pow(2).mean().backward()
        opt.zero_grad()
        assert not differing(model, ref)  # the failed step updated nothing (gradients kept)
        for i in range(4):
            assert step(model, opt, next(mine), seed=i) == step(ref, ropt, next(other), seed=i)
            assert not differing(model, ref)
    finally:
        fit.remove()
