"""Check 4: a GPT-2-medium-shaped model (24 layers x 1024; random weights) managed at 25% of its
weights, under Flow and under Genoa, for inference.

For each policy: logits equal the plain model's; the manager's own device peak stays within the
budget (its hard limit); on CUDA the allocator's peak *reserved* bytes during the forwards,
above what was reserved before the model existed on the device, stay within the budget plus
the step's activations (the plain forward's peak allocated above its weights), with 10% for the
allocator's rounding and fragmentation; the time per forward against plain and against
accelerate's ``cpu_offload`` (weights in CPU memory, moved in per module). On the CPU the same
runs small, without accelerate (nowhere to offload to from the CPU).

Layer: the check package.
"""

from __future__ import annotations

import gc
from functools import partial
from typing import Any

import torch

import tensorscope as ts
from tensorscope._units import format_bytes
from tensorscope.check.context import Context
from tensorscope.check.measure import allocator, gpt2, median_seconds, sync, tokens, warm_up

__all__ = ["run"]


def _shape(ctx: Context) -> dict[str, int]:
    if ctx.small:
        return {"layers": 4, "width": 128, "heads": 4, "vocab": 2048, "batch": 2, "length": 32}
    return {"layers": 24, "width": 1024, "heads": 16, "vocab": 50257, "batch": 2, "length": 256}


def _build(ctx: Context, state: dict[str, torch.Tensor] | None) -> torch.nn.Module:
    s = _shape(ctx)
    model = gpt2(s["layers"], s["width"], s["heads"], s["vocab"], 1024, ctx.device)
    if state is not None:
        model.load_state_dict(state)
    model.eval()
    return model


def _weights(model: torch.nn.Module) -> int:
    seen = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(seen.values())


def run(ctx: Context) -> None:
    device = ctx.device
    s = _shape(ctx)
    repeats = 3
    warm_up(device)
    ids = tokens(s["batch"], s["length"], s["vocab"], device)
    base = allocator(device)
    model = _build(ctx, None)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    weight_bytes = _weights(model)
    budget = weight_bytes // 4
    ctx.note("shape", {**s, "weights": format_bytes(weight_bytes), "budget": format_bytes(budget)})

    def forward(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            logits: torch.Tensor = m(ids).logits
        return logits

    expected = forward(model).to("cpu", copy=True)
    activations = 0
    if ctx.cuda:
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        forward(model)
        activations = torch.cuda.max_memory_allocated(device) - before
        ctx.note("plain forward's activations (peak allocated above the weights)", activations)
    plain_s = median_seconds(partial(forward, model), device, repeats)
    ctx.note("plain seconds per forward", plain_s)
    del model
    _free(device)
    times: dict[str, float] = {"plain": plain_s}
    if ctx.cuda:
        times["accelerate cpu_offload"] = _accelerate(ctx, state, forward, repeats, expected)
    for policy in ("flow", "genoa"):
        seconds = _managed(
            ctx, policy, state, budget, activations, base, forward, repeats, expected
        )
        times[policy] = seconds
        ctx.note(f"{policy}: seconds per forward / plain", seconds / plain_s)
        if "accelerate cpu_offload" in times:
            ctx.note(
                f"{policy}: seconds per forward / accelerate cpu_offload",
                seconds / times["accelerate cpu_offload"],
            )
    ctx.note("seconds per forward", times)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        sync(device)
        torch.cuda.empty_cache()


def _managed(
    ctx: Context,
    policy: str,
    state: dict[str, torch.Tensor],
    budget: int,
    activations: int,
    base: dict[str, int],
    forward: Any,
    repeats: int,
    expected: torch.Tensor,
) -> float:
    device = ctx.device
    model = _build(ctx, state)
    ts.residency.configure(device=str(device), policy=policy, budget=budget)
    handle = ts.manage(model)
    try:
        _free(device)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        first = forward(model).to("cpu", copy=True)  # Flow records this one
        seconds = median_seconds(partial(forward, model), device, repeats)
        last = forward(model).to("cpu", copy=True)
        report = ts.residency.report()
        for name, logits in (("first", first), ("last", last)):
            diff = (logits - expected).abs().max().item()
            ctx.expect(
                f"{policy}: logits of the {name} forward equal plain's",
                torch.equal(logits, expected),
                f"max |diff| {diff:.3g}",
                "equal",
            )
        device_peak = report.tiers["device"].peak_bytes
        ctx.expect(
            f"{policy}: manager's device peak within the budget",
            device_peak <= budget,
            format_bytes(device_peak),
            f"<= {format_bytes(budget)}",
        )
        ctx.note(
            f"{policy}: transfers",
            {
                "count": report.transfers.count,
                "bytes": report.transfers.bytes,
                "prefetches": report.prefetches,
            },
        )
        if ctx.cuda:
            stats = allocator(device)
            above = stats["max_reserved"] - base["reserved"]
            allowed = budget + activations
            ctx.note(f"{policy}: allocator", {**stats, "reserved_before_model": base["reserved"]})
            ctx.expect(
                f"{policy}: peak reserved above the start <= 1.10 x (budget + activations)",
                above <= 1.10 * allowed,
                f"{format_bytes(above)} ({above / allowed:.3f}x)",
                f"<= {format_bytes(int(1.10 * allowed))}",
            )
        return seconds
    finally:
        handle.remove()
        ts.residency.reset()
        del model
        _free(device)


def _accelerate(
    ctx: Context, state: dict[str, torch.Tensor], forward: Any, repeats: int, expected: torch.Tensor
) -> float:
    """accelerate's ``cpu_offload``: the weights in CPU memory, each module's moved in for its
    forward (its hooks) -- the usual way to run a model larger than the GPU."""
    from accelerate import cpu_offload

    model = _build(ctx, state).to("cpu")
    cpu_offload(model, execution_device=ctx.device)
    try:
        logits = forward(model).to("cpu", copy=True)
        diff = (logits - expected).abs().max().item()
        ctx.note("accelerate cpu_offload: max |logits - plain|", diff)
        seconds = median_seconds(partial(forward, model), ctx.device, repeats)
        ctx.note("accelerate cpu_offload seconds per forward", seconds)
        return seconds
    finally:
        del model
        _free(ctx.device)
