"""How exact and how cheap is ``ts.record()``'s memory plan? Ratios side by side, one run.

Workload: a GPT-2-small-shaped transformers model (12 layers, hidden 768, 12 heads, vocab
50257: 124 M parameters) from a config with random weights, AdamW, one training step of a
batch of ``--rows`` x ``--seq`` tokens; ``--quick``: 4 layers, hidden 256, vocab 8192.

What it prints (a markdown table per part; the date and command first):
1. Overhead: the step's time while recorded over the plain step's (rounds of plain, recorded,
   plain: each recorded step against the mean of its neighbours; the median round), and the
   cost of a small op before any recording and after them all (nothing stays installed).
2. Accuracy: ``plan.peak_bytes`` against the allocator's peak. The reference is independent of
   the plan: the storages that exist before the step (parameters, optimizer state, the batch,
   summed here from the model and the optimizer) plus the highest ``total_allocated`` that
   ``torch.profiler`` (``profile_memory=True``) reports for the same step. Parameters and
   optimizer state at the peak against their storages' bytes.
3. ``what_if`` against the change actually made, measured the same way, on two steps: one
   whose activations dominate (``--big-rows`` x ``--seq``) for recomputing and offloading, one
   whose parameters, gradients and optimizer state dominate (1 x 64) for freeing gradients.
   The changes: recomputing blocks
   (``torch.utils.checkpoint``, non-reentrant, on HF's ``GradientCheckpointingLayer``s),
   freeing gradients at their update (one optimizer per parameter stepped in
   ``register_post_accumulate_grad_hook``), offloading blocks' saved activations (saved-tensor
   hooks that keep them as Python bytes, outside torch's allocator, until backward).
4. Peers on the same step: ``torch.distributed._tools.mem_tracker.MemTracker`` and the
   profiler's memory timeline (``profile(profile_memory=True, record_shapes=True,
   with_stack=True)`` + ``export_memory_timeline``): what each shows, its overhead, its peak
   against the same reference.

Run: ``python benchmarks/plan_accuracy.py`` (``--quick`` for a small model).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import tensorscope as ts
from tensorscope.check.measure import profiler_peak

Step = Callable[[], None]


# ------------------------------------------------------------------------------ workload
def build(quick: bool) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if quick:
        config = tf.GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=8192, n_positions=512)
    else:
        config = tf.GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257)
    config._attn_implementation = "eager"
    config.bos_token_id = config.eos_token_id = 0
    model = tf.GPT2LMHeadModel(config)
    model.train()
    return model


def make_step(model: nn.Module, opt: torch.optim.Optimizer, rows: int, seq: int) -> Step:
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=torch.Generator())
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}

    def step() -> None:
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    step.inputs = inputs  # type: ignore[attr-defined]
    return step


def storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(seen.values())


def existing_bytes(model: nn.Module, opts: list[torch.optim.Optimizer], step: Step) -> int:
    """Bytes that exist before the step, from the model, optimizers and batch themselves."""
    tensors: list[Any] = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for opt in opts:
        tensors += [v for s in opt.state.values() for v in s.values()]
    tensors += list(getattr(step, "inputs", {}).values())
    return storage_bytes(tensors)


def allocator_increase(step: Step) -> int:
    """The highest bytes torch's CPU allocator held above its start during ``step``."""
    return profiler_peak(step)


def reference_peak(model: nn.Module, opts: list[torch.optim.Optimizer], step: Step) -> int:
    base = existing_bytes(model, opts, step)
    return base + allocator_increase(step)


def recorded(step: Step) -> ts.MemoryPlan:
    with ts.record() as rec:
        step()
    return rec.plan()


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


# ------------------------------------------------------------------------------- part 1
def timed(step: Step, record: bool = False) -> tuple[float, float]:
    """Wall and process CPU seconds of one step."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    if record:
        with ts.record():
            step()
    else:
        step()
    return time.perf_counter() - wall, time.process_time() - cpu


def overhead(step: Step, rounds: int) -> dict[str, float]:
    """Rounds of plain, recorded, plain: each round's ratio is the recorded step over the mean
    of the two plain steps around it (drift of this shared machine hits both sides)."""
    wall, cpu, plain, during = [], [], [], []
    for _ in range(rounds):
        before, recorded_s, after = timed(step), timed(step, True), timed(step)
        wall.append(recorded_s[0] / ((before[0] + after[0]) / 2))
        cpu.append(recorded_s[1] / ((before[1] + after[1]) / 2))
        plain += [before[0], after[0]]
        during.append(recorded_s[0])
    med = statistics.median
    return {
        "plain_s": med(plain),
        "recorded_s": med(during),
        "recorded": med(wall),
        "recorded_cpu": med(cpu),
        "rounds": rounds,
    }


def per_op_us(reps: int = 15, n: int = 20_000) -> float:
    """Thread CPU time of a 64-element add, µs (the best of ``reps`` loops of ``n``)."""
    a, b = torch.randn(64), torch.randn(64)
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        for _ in range(n):
            a + b
        best = min(best, time.thread_time() - start)
    return best / n * 1e6


def global_state() -> tuple[int, ...]:
    from torch.nn.modules import module as module_hooks
    from torch.optim import optimizer as optimizer_hooks

    return (
        len(module_hooks._global_forward_pre_hooks),
        len(module_hooks._global_forward_hooks),
        len(optimizer_hooks._global_optimizer_pre_hooks),
        len(optimizer_hooks._global_optimizer_post_hooks),
        torch._C._len_torch_dispatch_stack(),
        int(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None),
    )


# ------------------------------------------------------------------------------- part 3
@contextmanager
def checkpointed(model: nn.Module, blocks: list[int]) -> Iterator[None]:
    layers = model.transformer.h
    for i in blocks:
        layers[i].gradient_checkpointing = True
        layers[i]._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    try:
        yield
    finally:
        for i in blocks:
            layers[i].gradient_checkpointing = False


def optimizer_in_backward(model: nn.Module, opt: torch.optim.Optimizer, step: Step) -> Step:
    """One AdamW per parameter, sharing ``opt``'s state, stepped as each gradient is final."""
    group = opt.param_groups[0]
    per_param = {
        p: torch.optim.AdamW([p], lr=group["lr"], weight_decay=group["weight_decay"])
        for p in model.parameters()
    }
    for p, single in per_param.items():
        single.state[p] = opt.state[p]

    def hook(p: torch.Tensor) -> None:
        per_param[p].step()
        per_param[p].zero_grad(set_to_none=True)

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    inputs = step.inputs  # type: ignore[attr-defined]

    def fused_step() -> None:
        model(**inputs).loss.backward()

    fused_step.inputs = inputs  # type: ignore[attr-defined]
    fused_step.handles = handles  # type: ignore[attr-defined]
    fused_step.optimizers = list(per_param.values())  # type: ignore[attr-defined]
    return fused_step


@contextmanager
def offloaded(model: nn.Module, blocks: list[int]) -> Iterator[None]:
    """Saved activations of the blocks leave torch's allocator (as Python bytes) until their
    backward unpacks them into fresh tensors; parameters (and views of them) stay."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}

    def pack(t: torch.Tensor) -> Any:
        if t.untyped_storage()._cdata in params:
            return t
        return (t.dtype, t.shape, t.detach().contiguous().numpy().tobytes())

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        dtype, shape, data = packed
        return torch.frombuffer(bytearray(data), dtype=dtype).view(shape).clone()

    contexts: dict[int, Any] = {}

    def enter(module: nn.Module, args: Any) -> None:
        contexts[id(module)] = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        contexts[id(module)].__enter__()

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        contexts.pop(id(module)).__exit__(None, None, None)

    handles = []
    for i in blocks:
        block = model.transformer.h[i]
        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def what_if_rows(
    model: nn.Module, opt: torch.optim.Optimizer, step: Step, plan: ts.MemoryPlan, what: str
) -> list[tuple[str, int, int, int]]:
    """(change, recorded, predicted, measured) for the changes named in ``what``."""
    layers = len(model.transformer.h)
    half = list(range(layers // 2))
    every = list(range(layers))
    rows = []
    if "recompute" in what:
        for label, chosen in (("recompute every block", every), ("recompute half", half)):
            predicted = plan.what_if(recompute=[model.transformer.h[i] for i in chosen])
            with checkpointed(model, chosen):
                step()
                measured = reference_peak(model, [opt], step)
            rows.append((label, plan.peak_bytes, predicted.peak_bytes, measured))
    if "offload" in what:
        for label, chosen in (("offload every block", every), ("offload half", half)):
            predicted = plan.what_if(offload=[f"transformer.h.{i}" for i in chosen])
            with offloaded(model, chosen):
                step()
                measured = reference_peak(model, [opt], step)
            rows.append((label, plan.peak_bytes, predicted.peak_bytes, measured))
    if "free" in what:
        predicted = plan.what_if(free_gradients=True)
        fused = optimizer_in_backward(model, opt, step)
        try:
            fused()
            optimizers = [opt, *fused.optimizers]  # type: ignore[attr-defined]
            measured = reference_peak(model, optimizers, fused)
        finally:
            for handle in fused.handles:  # type: ignore[attr-defined]
                handle.remove()
        rows.append(
            ("free gradients at their update", plan.peak_bytes, predicted.peak_bytes, measured)
        )
    return rows


# ------------------------------------------------------------------------------- part 4
def mem_tracker(model: nn.Module, opt: torch.optim.Optimizer, step: Step) -> tuple[float, int, int]:
    """One step under MemTracker: its seconds, the peak it reports, and the parameters plus
    optimizer state in its peak snapshot."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    inputs = step.inputs.values()  # type: ignore[attr-defined]
    tracker.track_external(model, opt, *(t for t in inputs if isinstance(t, torch.Tensor)))
    start = time.perf_counter()
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore")
        step()
    seconds = time.perf_counter() - start
    snapshots = tracker.get_tracker_snapshot("peak").values()
    peak = sum(snap["Total"] for snap in snapshots)
    state = sum(snap.get("Parameter", 0) + snap.get("Optstate", 0) for snap in snapshots)
    return seconds, peak, state


def profiler_timeline(step: Step) -> tuple[float, float, int, int]:
    """One profiled step: its seconds, the export's seconds, the timeline's peak, and the
    parameters plus optimizer state it shows at that peak."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import (
        _CATEGORY_TO_INDEX,
        Category,
        MemoryProfileTimeline,
    )

    start = time.perf_counter()
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof.export_memory_timeline(os.path.join(folder, "timeline.json"), device="cpu")
    export_s = time.perf_counter() - start
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    row = max(sizes, key=sum)
    state = sum(
        row[_CATEGORY_TO_INDEX[c] + 1] for c in (Category.PARAMETER, Category.OPTIMIZER_STATE)
    )
    return seconds, export_s, sum(row), state


# ---------------------------------------------------------------------------------- parts
def part_overhead(step: Step, rounds: int) -> dict[str, float]:
    idle_before = per_op_us()
    state_before = global_state()
    cost = overhead(step, rounds)
    idle_after = per_op_us()
    print("| step | seconds (median) | vs plain, wall | vs plain, CPU time |")
    print("|---|---:|---:|---:|")
    print(f"| plain | {cost['plain_s']:.2f} | 1.00x | 1.00x |")
    print(
        f"| recorded (`ts.record()`) | {cost['recorded_s']:.2f} | {cost['recorded']:.2f}x | "
        f"{cost['recorded_cpu']:.2f}x |"
    )
    print(
        f"\n64-element add, thread CPU time: {idle_before:.2f} µs before any recording, "
        f"{idle_after:.2f} µs after ({idle_after / idle_before:.2f}x); torch's global hooks, "
        f"dispatch modes and saved-tensor hooks as before: {global_state() == state_before}\n"
    )
    return cost


def part_accuracy(
    model: nn.Module, opt: torch.optim.Optimizer, step: Step, plan: ts.MemoryPlan, reference: int
) -> None:
    params = storage_bytes(model.parameters())
    base = existing_bytes(model, [opt], step)
    state = storage_bytes([v for s in opt.state.values() for v in s.values()])
    print(plan, "\n")
    print("| quantity | plan | reference | ratio |\n|---|---:|---:|---:|")
    rows = [
        ("peak (bytes alive at the step's peak)", plan.peak_bytes, reference),
        ("peak above what existed before the step", plan.peak_bytes - base, reference - base),
        ("parameters at the peak", plan.at_peak["parameter"], params),
        ("optimizer state at the peak", plan.at_peak["optimizer_state"], state),
    ]
    for label, mine, theirs in rows:
        print(f"| {label} | {mine:,} | {theirs:,} | {mine / theirs:.4f} |")
    print()


def part_what_if(
    model: nn.Module, opt: torch.optim.Optimizer, step: Step, args: argparse.Namespace
) -> None:
    rows = []
    for rows_, seq, what in ((args.big_rows, args.seq, "recompute offload"), (1, 64, "free")):
        other = make_step(model, opt, rows_, seq)
        other()
        base_plan = recorded(other)
        for row in what_if_rows(model, opt, other, base_plan, what):
            rows.append((f"{row[0]} (batch {rows_} x {seq})", *row[1:]))
        del other, base_plan
        gc.collect()
    print("| change | recorded peak | predicted | measured | error |")
    print("|---|---:|---:|---:|---:|")
    for label, before, predicted, measured in rows:
        error = 100 * (predicted - measured) / measured
        print(f"| {label} | {mib(before)} | {mib(predicted)} | {mib(measured)} | {error:+.1f}% |")
    print()


def part_peers(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: Step,
    plan: ts.MemoryPlan,
    reference: int,
    recorded_ratio: float,
    rounds: int,
) -> None:
    tracker, timeline, export = [], [], []
    tracker_peak = timeline_peak = tracker_state = timeline_state = 0
    for _ in range(max(1, rounds - 2)):
        plain_s = timed(step)[0]
        seconds, tracker_peak, tracker_state = mem_tracker(model, opt, step)
        tracker.append(seconds / plain_s)
        plain_s = timed(step)[0]
        seconds, export_s, timeline_peak, timeline_state = profiler_timeline(step)
        timeline.append(seconds / plain_s)
        export.append(export_s)
    exact = storage_bytes(model.parameters())
    exact += storage_bytes([v for s in opt.state.values() for v in s.values()])
    mine = plan.at_peak["parameter"] + plan.at_peak["optimizer_state"]
    med = statistics.median
    print(
        "| tool | categories | user line of the peak | per-op timeline | predicts a change | "
        "step time vs plain | peak vs allocator | parameters + optimizer state at its peak vs "
        "their storages |\n|---|---|---|---|---|---:|---:|---:|"
    )
    print(
        f"| tensorscope `ts.record()` | 6 | yes | yes (+ memory_viz snapshot, PNG) | yes "
        f"(`what_if`) | {recorded_ratio:.2f}x | {plan.peak_bytes / reference:.3f} | "
        f"{mine / exact:.3f} |"
    )
    print(
        f"| `MemTracker` (torch.distributed._tools) | 7, per module, at module boundaries | no "
        f"| no (module snapshots) | no | {med(tracker):.2f}x | {tracker_peak / reference:.3f} | "
        f"{tracker_state / exact:.3f} |"
    )
    print(
        f"| profiler memory timeline (`export_memory_timeline`) | 8, inferred from the op graph "
        f"| no (stacks per op event) | yes (by time) | no | {med(timeline):.2f}x (+ "
        f"{med(export):.1f} s export) | {timeline_peak / reference:.3f} | "
        f"{timeline_state / exact:.3f} |"
    )


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (smoke run)")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--big-rows", type=int, default=12, help="rows of the activation-heavy what_if step"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (1: CPU time is stable under load)"
    )
    parser.add_argument(
        "--parts",
        default="overhead,accuracy,whatif,peers",
        help="which parts to run, comma-separated (default: all four)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{datetime.date.today()}: python benchmarks/plan_accuracy.py {' '.join(sys.argv[1:])}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s)\n")
    model = build(args.quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = make_step(model, opt, args.rows, args.seq)
    step()  # the optimizer's state exists from now on: every step below is a steady one
    params = storage_bytes(model.parameters())
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters "
        f"({mib(params)}), batch {args.rows} x {args.seq}\n"
    )
    parts = set(args.parts.split(","))
    cost = {"recorded": float("nan")}
    if "overhead" in parts:
        cost = part_overhead(step, args.rounds)
    if parts & {"accuracy", "peers"}:
        plan = recorded(step)
        reference = reference_peak(model, [opt], step)
        if "accuracy" in parts:
            part_accuracy(model, opt, step, plan, reference)
        if "peers" in parts:
            part_peers(model, opt, step, plan, reference, cost["recorded"], args.rounds)
    if "whatif" in parts:
        part_what_if(model, opt, step, args)


if __name__ == "__main__":
    main()
