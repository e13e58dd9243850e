"""Two processes on gloo for the distributed compatibility tests: a free port, and a run of a
worker ``target(rank, port, results)`` per rank that puts ``(rank, outcome)`` on ``results``."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


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
