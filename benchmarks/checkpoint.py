"""Checkpointable vs torch.utils.checkpoint.checkpoint_sequential vs plain, on a deep MLP (CPU).

For each method: the peak activation memory of one training step, measured with tensorscope's
own storage accounting (input, activations, gradients and temporaries; parameters and their
gradients excluded), and the median step time over interleaved repetitions. Checkpointable
runs at the least limit that fits and at each checkpoint_sequential peak (equal memory).

    python benchmarks/checkpoint.py            # about two minutes on 2 CPU cores
    python benchmarks/checkpoint.py --quick    # a smaller model, for a smoke test
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from tensorscope._units import format_bytes
from tensorscope.checkpoint import Chain, Checkpointable, min_memory, solve, store_all_memory
from tensorscope.checkpoint.tracker import StorageTracker


@dataclass
class Method:
    name: str
    run: Callable[[torch.Tensor], torch.Tensor]
    limit: int | None = None
    predicted_overhead: float | None = None
    peak: int = 0
    times: list[float] = field(default_factory=list)  # CPU seconds of this process
    walls: list[float] = field(default_factory=list)  # wall-clock seconds

    @property
    def time_s(self) -> float:
        return statistics.median(self.times)

    @property
    def wall_s(self) -> float:
        return statistics.median(self.walls)


def make_model(depth: int, width: int, classes: int) -> nn.Sequential:
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def step(method: Method, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(method.run(x), y).backward()


def measure_peak(method: Method, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    params = list(model.parameters())
    with StorageTracker() as tracker:
        step(method, model, x, y)
    peak = tracker.window_peak([p.grad for p in params if p.grad is not None])
    tracker.close()
    return x.nbytes + peak


def solver_speed(layers: int, slots: int) -> float:
    """Seconds to solve a random heterogeneous chain of ``layers`` layers on ``slots`` slots."""
    rng = random.Random(0)
    x = [rng.randint(1, 8) * 2**20 for _ in range(layers + 1)]
    chain = Chain(
        [rng.uniform(1e-3, 5e-3) for _ in range(layers)],
        [rng.uniform(2e-3, 9e-3) for _ in range(layers)],
        x,
        [0] + [v * rng.randint(1, 3) for v in x[1:]],
        [rng.randint(0, 2**20) for _ in range(layers)],
        [rng.randint(0, 2**20) for _ in range(layers)],
    )
    least, top = min_memory(chain), store_all_memory(chain)
    start = time.perf_counter()
    solve(chain, (least + top) // 2, slots=slots)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=16, help="Linear+GELU blocks")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=21, help="interleaved timed repetitions")
    parser.add_argument("--segments", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="small model, 3 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.depth, args.width, args.batch, args.reps, args.segments = 6, 128, 64, 3, [2, 3]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    classes = 10
    model = make_model(args.depth, args.width, classes)
    x = torch.randn(args.batch, args.width)
    y = torch.randint(0, classes, (args.batch,))
    n_layers = 2 * args.depth + 1
    loss_tmp = 2 * args.batch * classes * 4  # cross-entropy: log-softmax output and its grad

    plain = Method("plain", model)
    baselines = [
        Method(
            f"checkpoint_sequential({s})",
            lambda t, s=s: checkpoint_sequential(model, s, t, use_reentrant=False),
        )
        for s in args.segments
        if s <= n_layers
    ]
    for m in [plain, *baselines]:
        m.peak = measure_peak(m, model, x, y)

    probe = Checkpointable(model, loss_tmp_nbytes=loss_tmp)
    probe.measure(x)
    least = min_memory(probe.chain()) + probe.reserved_nbytes
    limits = sorted({least, *(b.peak for b in baselines if b.peak >= least)})
    ours: list[Method] = []
    solve_s: list[float] = []
    for limit in limits:
        ck = Checkpointable(model, mem_limit=limit, loss_tmp_nbytes=loss_tmp)
        ck.measure(x)
        start = time.perf_counter()
        schedule = ck.compute_sequence()
        solve_s.append(time.perf_counter() - start)
        assert schedule is not None
        m = Method(f"Checkpointable({format_bytes(limit)})", ck, limit)
        chain = ck.chain()
        m.predicted_overhead = schedule.time / (sum(chain.fw) + sum(chain.bw)) - 1
        m.peak = measure_peak(m, model, x, y)
        ours.append(m)
    everything = [plain, *baselines, *ours]
    for m in everything:  # warm-up
        step(m, model, x, y)
    for _ in range(args.reps):
        for m in everything:
            start, cpu = time.perf_counter(), time.process_time()
            step(m, model, x, y)
            m.times.append(time.process_time() - cpu)
            m.walls.append(time.perf_counter() - start)

    base = plain.time_s
    print(
        f"deep MLP: {args.depth} x (Linear({args.width}) + GELU) + head = {n_layers} layers, "
        f"batch {args.batch}, {args.threads} thread(s), median of {args.reps} interleaved steps"
    )
    print("step: CPU time of this process (robust to other load on the machine); wall: clock")
    print(
        f"{'method':<34}{'peak':>11}{'limit':>11}{'step':>10}{'vs plain':>10}{'predicted':>11}"
        f"{'wall':>10}"
    )
    for m in everything:
        limit = format_bytes(m.limit) if m.limit is not None else "-"
        predicted = (
            f"{m.predicted_overhead * 100:+.1f}%" if m.predicted_overhead is not None else "-"
        )
        print(
            f"{m.name:<34}{format_bytes(m.peak):>11}{limit:>11}"
            f"{m.time_s * 1e3:>8.1f}ms{(m.time_s / base - 1) * 100:>+9.1f}%{predicted:>11}"
            f"{m.wall_s * 1e3:>8.1f}ms"
        )
    print("\nat equal memory: ours vs the fastest checkpoint_sequential whose measured peak is")
    print("(a) not above our measured peak, (b) not above our limit")
    for m in ours:
        fits = "peak <= limit" if m.limit is not None and m.peak <= m.limit else "PEAK > LIMIT"
        overhead = (m.time_s / base - 1) * 100
        row = f"  {m.name:<30} {fits}; ours {m.time_s * 1e3:.1f}ms ({overhead:+.1f}%)"
        for label, cap in (("a", m.peak), ("b", m.limit or 0)):
            rivals = [b for b in baselines if b.peak <= cap]
            if not rivals:
                row += f"; ({label}) none"
                continue
            best = min(rivals, key=lambda b: b.time_s)
            verdict = "ours faster" if m.time_s <= best.time_s else "ours SLOWER"
            row += f"; ({label}) {best.name} {best.time_s * 1e3:.1f}ms: {verdict}"
        print(row)
    print(
        f"\nsolve time (this chain, 500 slots): {max(solve_s):.2f} s max; "
        f"random 50-layer chain, 500 slots: {solver_speed(50, 500):.2f} s"
    )


if __name__ == "__main__":
    main()
