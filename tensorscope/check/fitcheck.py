"""Check 5: ``ts.fit`` trains a GPT-2 (12 layers x 768; random weights; AdamW) at two budgets:
HF's every-block checkpointing's peak, and 50% of the plain step's peak.

The plain model, the same model with HF's ``gradient_checkpointing_enable()`` and the fitted
one train on the same batches from the same weights (the RNG seeded per step: dropout draws
the same masks). On CUDA a step's peak is the allocator's ``max_memory_reserved`` (what runs
out of memory; API §12) and must stay within 1.10 x the budget from the third step on (the
first is recorded, the second decides and is recorded again); on the CPU it is what fit itself
measured of the decided step (``fit.measured_peak(fit.plan_after)``, tensor bytes: API §10).
Losses and final weights are compared with plain's (bit-identity is reported; CUDA's kernels
may round differently when a block is recomputed), and the seconds per step with plain's and
HF checkpointing's.

Layer: the check package.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import traceback
from typing import Any

import torch

import tensorscope as ts
from tensorscope._units import format_bytes
from tensorscope.check.context import Context
from tensorscope.check.measure import gpt2, sync, tokens, warm_up

__all__ = ["run"]

LIMIT = 1.10  # reserved may exceed the budget by this factor (the allocator's rounding)


def _shape(ctx: Context) -> dict[str, int]:
    if ctx.small:
        return {"layers": 3, "width": 64, "heads": 4, "vocab": 512, "batch": 4, "length": 32,
                "steps": 3}  # fmt: skip
    return {"layers": 12, "width": 768, "heads": 12, "vocab": 50257, "batch": 8, "length": 512,
            "steps": 5}  # fmt: skip


class Run:
    """One training run's findings."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.peaks: list[int] = []  # per step (CUDA: max reserved; CPU: unused)
        self.seconds: list[float] = []
        self.weights: dict[str, torch.Tensor] = {}

    def median_s(self, skip: int) -> float:
        return statistics.median(self.seconds[skip:] or self.seconds)


def _train(
    ctx: Context, state: dict[str, torch.Tensor], data: list[torch.Tensor], how: str, budget: int
) -> tuple[Run, Any]:
    s = _shape(ctx)
    device = ctx.device
    model: Any = gpt2(s["layers"], s["width"], s["heads"], s["vocab"], 1024, device)
    model.load_state_dict(state)
    model.config.use_cache = False
    model.train()
    if how == "hf":
        _hf_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    fit = ts.fit(model, opt, budget=budget) if how == "fit" else None
    found = Run()
    try:
        for k, ids in enumerate(data):
            torch.manual_seed(k)
            _clean(device)
            start = time.perf_counter()
            with ts.scope() if fit is not None else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                found.losses.append(float(loss.item()))
            sync(device)
            found.seconds.append(time.perf_counter() - start)
            if ctx.cuda:
                found.peaks.append(torch.cuda.max_memory_reserved(device))
        found.weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        plan_peak = (
            _recorded_peak(ctx, model, opt, data[-1]) if how != "fit" and not ctx.cuda else 0
        )
        extra = (
            {"explain": fit.explain(), "measured": _fit_peak(fit)} if fit else {"plan": plan_peak}
        )
        return found, extra
    finally:
        if fit is not None:
            fit.remove()
        del model, opt
        _clean(device, empty=True)


def _hf_checkpointing(model: Any) -> None:
    """Every block checkpointed, HF's way (transformers 5.2x renamed the method)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _recorded_peak(ctx: Context, model: Any, opt: Any, ids: torch.Tensor) -> int:
    """CPU: the recorded peak of one more step (tensor bytes, what fit's budget counts)."""
    with ts.record() as rec:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return rec.plan().peak_bytes


def _fit_peak(fit: Any) -> int:
    return int(fit.measured_peak(fit.plan_after)) if fit.plan_after is not None else 0


def _clean(device: torch.device, empty: bool = False) -> None:
    if device.type != "cuda":
        return
    sync(device)
    if empty:
        gc.collect()
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def run(ctx: Context) -> None:
    s = _shape(ctx)
    device = ctx.device
    warm_up(device)
    data = [tokens(s["batch"], s["length"], s["vocab"], device, seed=10 + k)
            for k in range(s["steps"])]  # fmt: skip
    model = gpt2(s["layers"], s["width"], s["heads"], s["vocab"], 1024, device)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    del model
    _clean(device, empty=True)
    ctx.note("shape", s)
    plain, plain_extra = _train(ctx, state, data, "plain", 0)
    hf, hf_extra = _train(ctx, state, data, "hf", 0)
    if ctx.cuda:
        plain_peak, hf_peak = max(plain.peaks[1:]), max(hf.peaks[1:])
    else:
        plain_peak, hf_peak = plain_extra["plan"], hf_extra["plan"]
    ctx.note(
        "plain: peak per step" if ctx.cuda else "plain: recorded peak", plain.peaks or plain_peak
    )
    ctx.note(
        "HF checkpointing: peak per step" if ctx.cuda else "HF checkpointing: recorded peak",
        hf.peaks or hf_peak,
    )
    ctx.note("seconds per step (median from step 2)", {
        "plain": plain.median_s(1), "hf_checkpointing": hf.median_s(1)})  # fmt: skip
    for label, budget in (("HF checkpointing's peak", hf_peak), ("50% of plain", plain_peak // 2)):
        try:
            fitted, extra = _train(ctx, state, data, "fit", budget)
        except Exception as exc:  # this budget's finding; the other still runs
            ctx.note(f"fit at {label}: traceback", traceback.format_exc())
            ctx.expect(
                f"fit at {label} ({format_bytes(budget)}): trained",
                False,
                f"{type(exc).__name__}: {exc}"[:300],
                "no error",
            )
            continue
        _judge(ctx, label, budget, fitted, extra, plain, hf, state)


def _weight_gap(
    fitted: dict[str, torch.Tensor],
    plain: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
) -> tuple[float, float]:
    """The largest difference of a weight, and the norm of the difference of the two runs'
    updates relative to the norm of plain's update."""
    worst, gap, norm = 0.0, 0.0, 0.0
    for key, value in plain.items():
        if not value.is_floating_point():
            continue
        diff = (fitted[key] - value).double()
        worst = max(worst, diff.abs().max().item())
        gap += diff.square().sum().item()
        norm += (value - initial[key]).double().square().sum().item()
    return worst, (gap / norm) ** 0.5 if norm else float(gap > 0)


def _judge(
    ctx: Context,
    label: str,
    budget: int,
    fitted: Run,
    extra: dict[str, Any],
    plain: Run,
    hf: Run,
    initial: dict[str, torch.Tensor],
) -> None:
    name = f"fit at {label} ({format_bytes(budget)})"
    if ctx.cuda:
        decided = fitted.peaks[2:]
        worst = max(decided, default=0)
        ctx.note(f"{name}: reserved peak per step", fitted.peaks)
        ctx.expect(
            f"{name}: reserved from step 3 on <= {LIMIT:.2f} x budget",
            bool(decided) and worst <= LIMIT * budget,
            f"{format_bytes(worst)} ({worst / budget:.3f}x)",
            f"<= {LIMIT:.2f}x",
        )
    measured = extra["measured"]
    ctx.expect(
        f"{name}: fit's measured peak of the decided step <= {LIMIT:.2f} x budget",
        0 < measured <= LIMIT * budget,
        f"{format_bytes(measured)} ({measured / budget:.3f}x)" if measured else "none",
        f"<= {LIMIT:.2f}x",
    )
    diffs = [abs(a - b) for a, b in zip(fitted.losses, plain.losses, strict=True)]
    exact = fitted.losses == plain.losses
    tolerance = 1e-3 if ctx.cuda else 1e-5
    ctx.expect(
        f"{name}: losses equal plain's (bit-identical: {exact})",
        max(diffs) <= tolerance * max(1.0, abs(plain.losses[0])),
        f"max |diff| {max(diffs):.3g}",
        f"<= {tolerance:g} relative",
    )
    largest, relative = _weight_gap(fitted.weights, plain.weights, initial)
    if ctx.cuda:  # CUDA's kernels may round differently: the updates must agree, not the bits
        ctx.expect(f"{name}: weight updates after {len(plain.losses)} steps agree with plain's",
                   relative <= 1e-3, f"|dfit - dplain| / |dplain| = {relative:.3g} "
                   f"(max |diff| {largest:.3g})", "<= 1e-3")  # fmt: skip
    else:
        ctx.expect(f"{name}: weights after {len(plain.losses)} steps equal plain's",
                   largest == 0.0, f"max |diff| {largest:.3g}", "0 (bit-identical)")  # fmt: skip
    seconds = fitted.median_s(2)
    ctx.note(f"{name}: seconds per step (median from step 3)", {
        "fit": seconds, "vs plain": seconds / plain.median_s(2),
        "vs hf_checkpointing": seconds / hf.median_s(2)})  # fmt: skip
    ctx.note(f"{name}: explain", extra["explain"])
