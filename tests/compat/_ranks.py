"""Two processes on gloo for the distributed compatibility tests: a free port, a run of a
worker ``target(rank, port, results)`` per rank that puts ``(rank, outcome)`` on ``results``, and
the small residual net the workers train."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


class ResidualBlock(torch.nn.Module):
    """``x + down(gelu(up(x)))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class ResidualNet(torch.nn.Module):
    """An 8-feature input, ``blocks`` residual blocks in a ``ModuleList`` (the chain ts.fit
    finds), 4 outputs; weights seeded 0, so every rank builds the same."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, width)
        self.layers = torch.nn.ModuleList(ResidualBlock(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_two_ranks(target: Callable[..., None], timeout: float = 180.0) -> dict[int, Any]:
    """Spawn ``target`` for ranks 0 and 1; their outcomes by rank (stragglers are killed)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    workers = [context.Process(target=target, args=(rank, port, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        return dict(results.get(timeout=timeout) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
