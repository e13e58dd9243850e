"""``what_if`` predictions against the change actually made, measured by torch's allocator
(tiny GPT-2 configs; the bench's GPT-2-small numbers are in docs/plan.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tensorscope as ts

from ._support import allocator_peak, batch, build, hf_step

pytestmark = pytest.mark.engine_independent  # recordings of plain steps (checked)

Step = Callable[[], None]


def _measured(step: Step, plan_of_it: ts.MemoryPlan) -> int:
    """The allocator's peak of ``step``: what existed before it plus what it allocated."""
    existing = sum(life.nbytes for life in plan_of_it.lifetimes if life.created < 0)
    return existing + allocator_peak(step)


def _plan(step: Step) -> ts.MemoryPlan:
    with ts.record() as rec:
        step()
    return rec.plan()


def _within(predicted: int, measured: int, tolerance: float = 0.10) -> bool:
    return abs(predicted - measured) <= tolerance * measured


def test_recomputing_blocks() -> None:
    model = build("gpt2", layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = hf_step(model, opt, rows=8, seq=64)
    step()
    plan = _plan(step)
    assert plan.peak_phase == "backward"  # activations dominate this step
    for chosen in ([0, 1, 2, 3], [1, 2]):
        predicted = plan.what_if(recompute=[model.transformer.h[i] for i in chosen])
        for i in chosen:
            block = model.transformer.h[i]
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        try:
            step()
            measured = _measured(step, _plan(step))
        finally:
            for i in chosen:
                model.transformer.h[i].gradient_checkpointing = False
        assert predicted.peak_bytes < plan.peak_bytes
        assert _within(predicted.peak_bytes, measured), (chosen, predicted.peak_bytes, measured)


def test_freeing_gradients_at_their_update() -> None:
    model = build("gpt2", layers=2, hidden=128)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = hf_step(model, opt, rows=1, seq=8)
    step()
    plan = _plan(step)
    assert plan.peak_phase == "optimizer"  # every gradient alive: the case this change helps
    predicted = plan.what_if(free_gradients=True)
    per_param = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}
    for p, single in per_param.items():
        single.state[p] = opt.state[p]

    def update(p: torch.Tensor) -> None:
        per_param[p].step()
        per_param[p].zero_grad(set_to_none=True)

    handles = [p.register_post_accumulate_grad_hook(update) for p in model.parameters()]
    inputs = batch(rows=1, seq=8)

    def fused() -> None:
        model(**inputs).loss.backward()

    try:
        fused()
        measured = _measured(fused, _plan(fused))
    finally:
        for handle in handles:
            handle.remove()
    assert predicted.peak_bytes < plan.peak_bytes
    assert _within(predicted.peak_bytes, measured), (predicted.peak_bytes, measured)


def test_offloading_saved_activations() -> None:
    model = build("gpt2", layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = hf_step(model, opt, rows=8, seq=64)
    step()
    plan = _plan(step)
    predicted = plan.what_if(offload=["transformer.h"])
    params = {p.untyped_storage()._cdata for p in model.parameters()}

    def pack(t: torch.Tensor) -> object:
        if t.untyped_storage()._cdata in params:
            return t
        return (t.dtype, t.shape, t.detach().contiguous().numpy().tobytes())

    def unpack(packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        dtype, shape, data = packed  # type: ignore[misc]
        return torch.frombuffer(bytearray(data), dtype=dtype).view(shape).clone()

    hooks: dict[int, torch.autograd.graph.saved_tensors_hooks] = {}

    def enter(module: torch.nn.Module, args: object) -> None:
        hooks[id(module)] = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks[id(module)].__enter__()

    def leave(module: torch.nn.Module, args: object, out: object) -> None:
        hooks.pop(id(module)).__exit__(None, None, None)

    handles = []
    for block in model.transformer.h:
        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    try:
        step()
        measured = _measured(step, _plan(step))
    finally:
        for handle in handles:
            handle.remove()
    assert predicted.peak_bytes < plan.peak_bytes
    assert _within(predicted.peak_bytes, measured), (predicted.peak_bytes, measured)
