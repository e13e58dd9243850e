"""Thread-safety under load (docs/design.md §7): 4 threads train in scoped loops while 2 threads
train managed models under one budget, for about 20 s; every thread ends exactly where the same
steps run alone end, and the budget is never exceeded.

``TENSORSCOPE_STRESS_S`` sets the duration (default 20).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

import tensorscope as ts

DURATION_S = float(os.environ.get("TENSORSCOPE_STRESS_S", "20"))
SCOPED, MANAGED = 4, 2


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 8)
    )


def _batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randn(16, 64, generator=generator), torch.randn(16, 8, generator=generator)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, step: int) -> float:
    x, y = _batch(seed, step)
    with ts.scope():
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return float(loss.item())


def _alone(seed: int, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    model = _model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = [_step(model, optimizer, seed, step) for step in range(steps)]
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_scoped_and_managed_threads_under_load_match_their_runs_alone() -> None:
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # per-op results then do not depend on what else runs
    try:
        _run()
    finally:
        torch.set_num_threads(threads_before)


def _run() -> None:
    workers = SCOPED + MANAGED
    models = [_model(seed) for seed in range(workers)]
    sizes = [p.numel() * 4 for p in models[0].parameters()]
    # Room for one Adam op on the largest weight; both managed models with Adam need ~6x this.
    budget = max(int(1.2 * sum(sizes)), 4 * max(sizes))
    ts.residency.configure(device="cpu", policy="flow", budget=budget)
    ts.residency.report(reset=True)
    losses: list[list[float]] = [[] for _ in range(workers)]
    errors: list[BaseException] = []
    deadline = time.monotonic() + DURATION_S
    start = threading.Barrier(workers)

    def work(index: int) -> None:
        try:
            model = models[index]
            handle = ts.manage(model) if index >= SCOPED else None
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            start.wait()
            step = 0
            while time.monotonic() < deadline:
                losses[index].append(_step(model, optimizer, index, step))
                step += 1
            if handle is not None:
                handle.remove()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DURATION_S + 120)
    assert not errors, errors
    peak = ts.residency.report().peak_bytes
    assert 0 < peak <= budget, f"peak {peak} B, budget {budget} B"
    for index in range(workers):
        steps = len(losses[index])
        assert steps > 0, f"thread {index} made no step"
        expected_losses, expected_params = _alone(index, steps)
        assert losses[index] == expected_losses, f"thread {index}: losses differ"
        for ours, theirs in zip(models[index].parameters(), expected_params, strict=True):
            assert type(ours) is nn.Parameter  # managed ones were removed
            assert torch.equal(ours, theirs), f"thread {index}: parameters differ"
