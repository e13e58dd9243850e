"""How exact and how cheap is ``ts.record()``'s memory plan? Ratios side by side, one run.

Workload: a GPT-2-small-shaped transformers model (12 layers, hidden 768, 12 heads, vocab
50257: 124 M parameters) from a config with random weights, AdamW, one training step of a
batch of ``--rows`` x ``--seq`` tokens; ``--quick``: 4 layers, hidden 256, vocab 8192.

What it prints (a markdown table per part; the date and command first):
1. Overhead: the step's time while recorded and after recordings, over the plain step's
   (steps before any recording). Rounds alternate recorded and plain steps; medians.
2. Accuracy: ``plan.peak_bytes`` against the allocator's peak. The reference is independent of
   the plan: the storages that exist before the step (parameters, optimizer state, the batch,
   summed here from the model and the optimizer) plus the highest ``total_allocated`` that
   ``torch.profiler`` (``profile_memory=True``) reports for the same step. Parameters and
   optimizer state at the peak against their storages' bytes.
3. ``what_if`` against the change actually made, measured the same way: recomputing blocks
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
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    peak = 0
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        if event.tag == _EventType.Allocation:
            peak = max(peak, event.extra_fields.total_allocated)
        todo.extend(event.children)
    return peak


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
def overhead(step: Step, rounds: int) -> dict[str, float]:
    def timed(record: bool) -> tuple[float, float]:
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        if record:
            with ts.record():
                step()
        else:
            step()
        return time.perf_counter() - wall, time.process_time() - cpu

    before = [timed(False) for _ in range(rounds)]
    during, after = [], []
    for _ in range(rounds):
        during.append(timed(True))
        after.append(timed(False))
    med = statistics.median
    plain_wall = med(t[0] for t in before)
    plain_cpu = med(t[1] for t in before)
    return {
        "plain_s": plain_wall,
        "recorded_s": med(t[0] for t in during),
        "after_s": med(t[0] for t in after),
        "recorded": med(t[0] for t in during) / plain_wall,
        "after": med(t[0] for t in after) / plain_wall,
        "recorded_cpu": med(t[1] for t in during) / plain_cpu,
        "after_cpu": med(t[1] for t in after) / plain_cpu,
    }


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
    model: nn.Module, opt: torch.optim.Optimizer, step: Step, plan: ts.MemoryPlan
) -> list[tuple[str, int, int]]:
    layers = len(model.transformer.h)
    half = list(range(layers // 2))
    every = list(range(layers))
    rows = []
    for label, chosen in (("recompute every block", every), ("recompute half", half)):
        predicted = plan.what_if(recompute=[f"transformer.h.{i}" for i in chosen]).peak_bytes
        with checkpointed(model, chosen):
            step()
            measured = reference_peak(model, [opt], step)
        rows.append((f"{label} (`torch.utils.checkpoint`)", predicted, measured))
    predicted = plan.what_if(offload=["transformer.h"]).peak_bytes
    with offloaded(model, every):
        step()
        measured = reference_peak(model, [opt], step)
    rows.append(("offload every block's saved activations", predicted, measured))
    predicted = plan.what_if(free_gradients=True).peak_bytes
    fused = optimizer_in_backward(model, opt, step)
    try:
        fused()
        measured = reference_peak(model, [opt, *fused.optimizers], fused)  # type: ignore[attr-defined]
    finally:
        for handle in fused.handles:  # type: ignore[attr-defined]
            handle.remove()
    rows.append(
        (
            "free gradients at their update (`register_post_accumulate_grad_hook`)",
            predicted,
            measured,
        )
    )
    return rows


# ------------------------------------------------------------------------------- part 4
def mem_tracker(model: nn.Module, opt: torch.optim.Optimizer, step: Step) -> tuple[float, int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    inputs = step.inputs.values()  # type: ignore[attr-defined]
    tracker.track_external(model, opt, *(t for t in inputs if isinstance(t, torch.Tensor)))
    start = time.perf_counter()
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("ignore")
        step()
    seconds = time.perf_counter() - start
    peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return seconds, peak


def profiler_timeline(step: Step) -> tuple[float, float, int]:
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

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
    return seconds, export_s, max(sum(row) for row in sizes)


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (smoke run)")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"{datetime.date.today()}: python benchmarks/plan_accuracy.py {' '.join(sys.argv[1:])}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    model = build(args.quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = make_step(model, opt, args.rows, args.seq)
    step()  # the optimizer's state exists from now on: every step below is a steady one
    params = storage_bytes(model.parameters())
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters "
        f"({mib(params)}), batch {args.rows} x {args.seq}\n"
    )

    cost = overhead(step, args.rounds)
    print("| step | seconds (median) | vs plain (wall) | vs plain (CPU) |\n|---|---:|---:|---:|")
    print(f"| plain | {cost['plain_s']:.2f} | 1.00x | 1.00x |")
    print(
        f"| recorded (`ts.record()`) | {cost['recorded_s']:.2f} | {cost['recorded']:.2f}x | "
        f"{cost['recorded_cpu']:.2f}x |"
    )
    print(
        f"| plain, after recordings | {cost['after_s']:.2f} | {cost['after']:.2f}x | "
        f"{cost['after_cpu']:.2f}x |\n"
    )

    plan = recorded(step)
    reference = reference_peak(model, [opt], step)
    base = existing_bytes(model, [opt], step)
    state = storage_bytes([v for s in opt.state.values() for v in s.values()])
    print(plan, "\n")
    print("| quantity | plan | reference | ratio |\n|---|---:|---:|---:|")
    print(
        f"| peak (bytes alive at the step's peak) | {plan.peak_bytes:,} | {reference:,} | "
        f"{plan.peak_bytes / reference:.4f} |"
    )
    print(
        f"| peak above what existed before the step | {plan.peak_bytes - base:,} | "
        f"{reference - base:,} | {(plan.peak_bytes - base) / (reference - base):.4f} |"
    )
    print(
        f"| parameters at the peak | {plan.at_peak['parameter']:,} | {params:,} | "
        f"{plan.at_peak['parameter'] / params:.4f} |"
    )
    print(
        f"| optimizer state at the peak | {plan.at_peak['optimizer_state']:,} | {state:,} | "
        f"{plan.at_peak['optimizer_state'] / state:.4f} |\n"
    )

    print("| change | predicted peak | measured peak | error |\n|---|---:|---:|---:|")
    for label, predicted, measured in what_if_rows(model, opt, step, plan):
        print(
            f"| {label} | {mib(predicted)} | {mib(measured)} | "
            f"{100 * (predicted - measured) / measured:+.1f}% |"
        )
    print()

    plain_s = cost["plain_s"]
    tracker_s, tracker_peak = mem_tracker(model, opt, step)
    profile_s, export_s, timeline_peak = profiler_timeline(step)
    print(
        "| tool | categories | user line of the peak | per-op timeline | predicts a change | "
        "CPU | step time vs plain | peak vs allocator |\n|---|---|---|---|---|---|---:|---:|"
    )
    print(
        f"| tensorscope `ts.record()` | 6, exact for parameters and optimizer state | yes | "
        f"yes (+ memory_viz snapshot, PNG) | yes (`what_if`) | yes | {cost['recorded']:.2f}x | "
        f"{plan.peak_bytes / reference:.3f} |"
    )
    print(
        f"| `MemTracker` (torch.distributed._tools) | 7 per module, at module boundaries | no "
        f"| no (module snapshots) | no | yes | {tracker_s / plain_s:.2f}x | "
        f"{tracker_peak / reference:.3f} |"
    )
    print(
        f"| profiler memory timeline (`export_memory_timeline`) | 8, inferred from the graph | "
        f"no (stacks per op event) | yes (by time) | no | yes | {profile_s / plain_s:.2f}x "
        f"(+ {export_s:.1f} s export) | {timeline_peak / reference:.3f} |"
    )


if __name__ == "__main__":
    main()
