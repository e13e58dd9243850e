"""Plans of transformers GPT-2, Llama and BERT training steps (tiny configs, random weights):
exact where bytes can be exact, inside and outside scopes, under ``ts.manage``, with
``torch.compile`` and ``torch.utils.checkpoint``."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tensorscope as ts

from ._support import BLOCKS, build, hf_step, state_tensors, storage_bytes

MODELS = ("gpt2", "llama", "bert")


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def _check_exact(plan: ts.MemoryPlan, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    assert sum(plan.at_peak.values()) == plan.peak_bytes
    assert plan.at_peak["parameter"] == storage_bytes(model.parameters())
    assert plan.at_peak["optimizer_state"] == storage_bytes(state_tensors(opt))
    params = [life for life in plan.lifetimes if life.category == "parameter"]
    assert {life.name for life in params} >= {
        name for name, _ in model.named_parameters(remove_duplicate=True)
    }


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("inside", ["plain", "scope"])
def test_training_step(name: str, inside: str) -> None:
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = hf_step(model, opt)
    step()
    wrap = ts.scope if inside == "scope" else _nothing
    with wrap(), ts.record() as rec:
        step()
    plan = rec.plan()
    _check_exact(plan, model, opt)
    blocks = BLOCKS[name]
    assert f"{blocks}.0" in plan.blocks and f"{blocks}.1" in plan.blocks
    block = next(c for c in plan.calls if c.path == f"{blocks}.1")
    assert block.backward is not None and block.saved_bytes > 0
    assert block.forward_s > 0 and block.backward_s > 0
    prediction = plan.what_if(recompute=[blocks], free_gradients=True)
    assert 0 < prediction.peak_bytes <= plan.peak_bytes
    assert plan.at_peak_by_tier is None


@pytest.mark.parametrize("name", MODELS)
def test_a_scope_opened_inside_the_recording(name: str) -> None:
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = hf_step(model, opt)
    step()
    with ts.record() as rec, ts.scope():
        step()
    _check_exact(rec.plan(), model, opt)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_under_the_residency_manager_per_tier(name: str) -> None:
    model = build(name)
    params = storage_bytes(model.parameters())
    ts.residency.configure(device="cpu", policy="flow", budget=int(params * 0.6))
    handle = ts.manage(model)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = hf_step(model, opt)
        with ts.scope():
            step()
        with ts.scope(), ts.record() as rec:
            step()
        plan = rec.plan()
        _check_exact(plan, model, opt)
        tiers = plan.at_peak_by_tier
        assert tiers is not None and "device" in tiers
        assert sum(sum(row.values()) for row in tiers.values()) == plan.peak_bytes
        for category in plan.at_peak:
            assert sum(row[category] for row in tiers.values()) == plan.at_peak[category]
        assert sum(tiers.get("disk", {}).values()) > 0  # the budget keeps some of it off
        assert "per residency tier" in str(plan)
    finally:
        handle.remove()


@pytest.mark.slow  # inductor compiles a GPT-2 step with the C++ compiler (cold: ~25 s of CPU)
def test_torch_compile_counts_a_graph_as_its_outputs() -> None:
    import torch._dynamo

    model = build("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="inductor")
    step = hf_step(compiled, opt)
    try:
        step()
        with pytest.warns(UserWarning, match="global hooks"), ts.record() as rec:
            step()
        plan = rec.plan()
        _check_exact(plan, model, opt)
        assert any(op.name == "compiled graph" for op in plan.ops)
        step()  # and after: compiled code runs as before the recording
    finally:
        torch._dynamo.reset()


def test_torch_utils_checkpoint_blocks_recompute_in_backward() -> None:
    model = build("gpt2", layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = hf_step(model, opt, rows=4, seq=64)
    step()
    with ts.record() as rec:
        step()
    plain = rec.plan()
    for block in model.transformer.h:
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    with ts.record() as rec:
        step()
    checkpointed = rec.plan()
    _check_exact(checkpointed, model, opt)
    assert any(c.recompute for c in checkpointed.calls)
    assert not any(c.recompute for c in plain.calls)
    assert checkpointed.peak_bytes < plain.peak_bytes
    assert checkpointed.at_peak["activation"] < plain.at_peak["activation"]
