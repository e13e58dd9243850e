"""What ``ts.manage()`` costs a model's ops: managed vs plain, side by side in one process.

Workloads (one thread by default):
(a) greedy HF ``generate()`` (16 new tokens, KV cache) of a Llama built from a config (8 layers,
    hidden 512, intermediate 1376, vocabulary 4096, untied head: 113 MiB of fp32 weights), under
    ``ts.manage`` with Flow at a budget of 150% of the weights (nothing ever moves: the pure cost
    of the op path) and at 50% (the weights stream from the disk tier, warm page cache);
(b) µs per op with everything resident: a 64-element add of a managed tensor and a plain one in
    a tight loop, against the same add of plain tensors; and the extra time of (a) at 150%
    divided by the ops of one ``generate()`` that touch a managed tensor or are seen at all.

Method: the plain model and the managed one are two copies of the same weights in one process;
the plain calls run on a worker thread of their own (the manager routes only the threads that
use managed tensors: on the main thread the plain model's ops would pay the interception too).
Calls alternate plain/managed (the order flips every call), each round's ratio is
median(managed) / median(plain) over its calls, and the reported ratio is the median over
rounds. The load average is printed: the machine is shared, ratios are what to read.

Run: ``python benchmarks/managed_overhead.py`` (``--quick`` for a short smoke run).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tensorscope as ts
from tensorscope._engine import engine_name

MIB = 1 << 20


def _llama() -> tuple[Any, Callable[[Any], None]]:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 4096, (1, 16))
    mask = torch.ones_like(ids)

    def generate(m: Any) -> None:
        with torch.no_grad():
            m.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )

    return model, generate


class _Count(TorchDispatchMode):
    """Counts the ops the residency manager's op path sees (all of them, below autograd)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _paths(model: Any, generate: Callable[[Any], None]) -> tuple[int, int]:
    """Ops of one call taken by the C++ fast path and handed to Python (0, 0: Python engine)."""
    try:
        from tensorscope.residency import native
    except ImportError:  # an older tensorscope
        return 0, 0
    before = native.counters()
    generate(model)
    after = native.counters()
    return after[0] - before[0], after[1] - before[1]


def _timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def ratio_of(
    plain: Callable[[], None], managed: Callable[[], None], rounds: int, calls: int
) -> tuple[float, float, float]:
    """(median plain s, median managed s, median over rounds of the per-round ratio)."""
    for _ in range(2):
        plain()
        managed()
    plain_all: list[float] = []
    managed_all: list[float] = []
    ratios: list[float] = []
    for round_index in range(rounds):
        p: list[float] = []
        m: list[float] = []
        for i in range(calls):
            first_managed = (round_index + i) % 2 == 1
            for managed_now in (first_managed, not first_managed):
                (m if managed_now else p).append(_timed(managed if managed_now else plain))
        ratios.append(statistics.median(m) / statistics.median(p))
        plain_all += p
        managed_all += m
    return statistics.median(plain_all), statistics.median(managed_all), statistics.median(ratios)


def per_op_us(repeats: int, n: int) -> tuple[float, float]:
    """(plain µs per add, managed µs per add), medians of interleaved loops. Each add reads one
    of 512 managed 64-element buffers, in turn (a loop over one tensor would look like an
    iteration of four ops to the recorder, and end one every four ops)."""
    a = torch.randn(64)
    plain_buffers = [torch.randn(64) for _ in range(512)]
    holder = torch.nn.Module()
    for i, b in enumerate(plain_buffers):
        holder.register_buffer(f"b{i}", b.clone())
    handle = ts.manage(holder)
    managed_buffers = [getattr(holder, f"b{i}") for i in range(512)]

    def loop(buffers: list[torch.Tensor]) -> float:
        rounds = max(1, n // len(buffers))
        start = time.perf_counter()
        for _ in range(rounds):
            for b in buffers:
                torch.add(b, a)
        return (time.perf_counter() - start) / (rounds * len(buffers)) * 1e6

    worker = ThreadPoolExecutor(max_workers=1)  # plain loops: a thread the manager never routes
    plain, managed = [], []
    for _ in range(repeats):
        plain.append(worker.submit(loop, plain_buffers).result())
        managed.append(loop(managed_buffers))
        ts.residency.report()  # the C++ op path's log replayed (its cost, counted here)
    handle.remove()
    return statistics.median(plain), statistics.median(managed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (smoke test)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budgets", default="150,50", help="budgets, %% of the weights")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, calls, op_repeats = (2, 2, 3) if args.quick else (5, 5, 9)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), engine "
        f"{engine_name()}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    plain_us, managed_us = per_op_us(op_repeats, 20000)
    print(
        f"{'64-element add, managed operand resident':<46}{plain_us:>8.2f}us{managed_us:>8.2f}us"
        f"{'+' + format(managed_us - plain_us, '.2f'):>9} us/op"
    )
    plain_model, generate = _llama()
    managed_model = copy.deepcopy(plain_model)
    weights = sum(p.numel() * p.element_size() for p in plain_model.parameters())
    counter = _Count()
    with counter:
        generate(plain_model)
    worker = ThreadPoolExecutor(max_workers=1)  # plain calls: a thread the manager never routes
    for percent in (int(x) for x in args.budgets.split(",")):
        budget = weights * percent // 100
        ts.residency.configure(device="cpu", policy="flow", budget=budget)
        handle = ts.manage(managed_model)
        try:
            plain_s, managed_s, ratio = ratio_of(
                lambda: worker.submit(generate, plain_model).result(),
                lambda: generate(managed_model),
                rounds,
                calls,
            )
            rep = ts.residency.report()
            paths = _paths(managed_model, generate)
        finally:
            handle.remove()
        name = f"Llama 8x512 generate(16), budget {percent}%"
        print(
            f"{name:<46}{plain_s * 1e3:>8.1f}ms{managed_s * 1e3:>8.1f}ms{ratio:>8.3f}x"
            f"  (peak {rep.tiers['device'].peak_bytes / MIB:.1f} of {budget / MIB:.1f} MiB)"
        )
        fast, slow = paths
        print(f"  ops on managed tensors per call: {fast} on the C++ fast path, {slow} in Python")
        if percent >= 100:
            added = (managed_s - plain_s) / counter.ops * 1e6
            label = f"  per op of the call ({counter.ops} ops)"
            print(f"{label:<46}{'':>20}{'+' + format(added, '.2f'):>9} us/op")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
