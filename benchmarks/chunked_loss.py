"""The LM head and loss of a Llama-shaped model, plain vs in row chunks: peak bytes and time.

Workload: hidden states ``[2 x 512, 576]`` (SmolLM-135M's width) that require grad, the head's
weight ``[32000, 576]``, targets with 10% ignored; one forward and backward of
``F.cross_entropy(F.linear(h, W).float(), y)`` (plain: what HF's ``ForCausalLMLoss`` runs)
against ``tensorscope.fit.chunkloss.linear_cross_entropy`` (chunked).

Bytes: ``ts.record``'s peak of the region (storage bytes alive at its peak, the inputs
included) and the same less the inputs (hidden states and weight): deterministic. Time: the
two alternate in one process (the order flips every round), median per round, median over
rounds; on a shared machine the times are rough.

Run: ``python benchmarks/chunked_loss.py`` (``--quick`` for one round; ``--dtype bfloat16``;
``--chunk-mib`` for the chunk size; ``--device cuda``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional

import tensorscope as ts
from tensorscope.fit.chunkloss import chunk_rows_for, linear_cross_entropy

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _inputs(
    rows: int, hidden: int, vocab: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
    y = torch.randint(0, vocab, (rows,), generator=g)
    y[torch.rand(rows, generator=g) < 0.1] = -100
    return h, w, y.to(device)


def _plain(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(functional.linear(h, w).float(), y)


def _peak(loss: Loss, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> int:
    h.grad = w.grad = None
    with ts.record() as rec:
        loss(h, w, y).backward()
    h.grad = w.grad = None
    return rec.plan().peak_bytes


def _seconds(loss: Loss, h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> float:
    h.grad = w.grad = None
    if h.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss(h, w, y).backward()
    if h.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of two runs")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chunk-mib", type=float, default=32.0, help="a chunk's fp32 logits")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = args.batch * args.seq
    h, w, y = _inputs(rows, args.hidden, args.vocab, dtype, args.device)
    chunk = chunk_rows_for(args.vocab, int(args.chunk_mib * (1 << 20)))

    def chunked(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(h, w, None, y, chunk_rows=chunk)

    losses: dict[str, Loss] = {"plain": _plain, "chunked": chunked}
    inputs = h.nbytes + w.nbytes + y.nbytes
    print(
        f"head [{rows}, {args.hidden}] x [{args.vocab}, {args.hidden}] {args.dtype} on "
        f"{args.device}; logits {rows * args.vocab * 4 / 2**20:.1f} MiB in float32; chunk "
        f"{chunk} rows; inputs {inputs / 2**20:.1f} MiB"
    )
    peaks = {name: _peak(loss, h, w, y) for name, loss in losses.items()}
    for loss in losses.values():  # warm up
        _seconds(loss, h, w, y)
    rounds, runs = (1, 2) if args.quick else (5, 3)
    medians: dict[str, list[float]] = {name: [] for name in losses}
    for r in range(rounds):
        order = list(losses) if r % 2 == 0 else list(reversed(losses))
        times: dict[str, list[float]] = {name: [] for name in losses}
        for _ in range(runs):
            for name in order:
                times[name].append(_seconds(losses[name], h, w, y))
        for name in losses:
            medians[name].append(statistics.median(times[name]))
    print(f"{'':8} {'peak MiB':>9} {'above inputs':>13} {'seconds':>8}")
    for name in losses:
        peak = peaks[name] / 2**20
        above = (peaks[name] - inputs) / 2**20
        print(f"{name:8} {peak:9.1f} {above:13.1f} {statistics.median(medians[name]):8.3f}")
    ratio = statistics.median(medians["chunked"]) / statistics.median(medians["plain"])
    print(f"chunked / plain: peak {peaks['chunked'] / peaks['plain']:.2f}x, time {ratio:.2f}x")


if __name__ == "__main__":
    main()
