"""Scoped training on several threads and in several asyncio tasks (item 10).

Each worker (a ``ThreadPoolExecutor`` thread, or an asyncio task) trains its own model with a
scope around each step; the results equal the same runs done one after the other without
tensorscope. In the residency modes each thread manages its own model (``ts.manage`` called on
that thread, the documented way to use a managed module from a thread) under one budget of 40% of
all models; asyncio tasks share the event loop's thread, whose models are managed up front.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tensorscope as ts

from . import _models as M

WORKERS = 3
STEPS = 4


def _models() -> list[torch.nn.Module]:
    return [M.mlp(seed=i) for i in range(WORKERS)]


def _sequential_plain() -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    results = []
    for i, model in enumerate(_models()):
        losses = M.mlp_train(model, M.mlp_batches(STEPS, seed=10 + i), M.Run("plain").step)
        results.append((losses, M.state_of(model)))
    return results


def _configure(mode: str, models: list[torch.nn.Module]) -> int | None:
    if mode not in M.RESIDENCY_MODES:
        return None
    budget = M.budget_for(*models)
    ts.residency.configure(device="cpu", policy=mode, budget=budget)
    ts.residency.report(reset=True)
    return budget


def _check(
    models: list[torch.nn.Module],
    losses: list[list[float]],
    budget: int | None,
) -> None:
    for i, (expected_losses, expected_state) in enumerate(_sequential_plain()):
        assert losses[i] == expected_losses, f"worker {i}"
        M.assert_same_state(models[i], expected_state)
    if budget is not None:
        assert ts.residency.report().peak_bytes <= budget


@pytest.mark.parametrize("mode", M.MODES)
def test_threads_each_training_their_own_model(mode: str) -> None:
    models = _models()
    budget = _configure(mode, models)
    start = threading.Barrier(WORKERS)

    def work(i: int) -> list[float]:
        if budget is not None:
            M.LIVE_HANDLES.append(ts.manage(models[i]))  # on this thread
        start.wait(timeout=60)  # all threads train at the same time
        return M.mlp_train(models[i], M.mlp_batches(STEPS, seed=10 + i), ts.scope)

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        losses = list(pool.map(work, range(WORKERS)))
    _check(models, losses, budget)


def test_threads_training_hf_models_in_scopes() -> None:
    """Two threads, each with a Llama-family model (no dropout: no shared RNG use)."""
    names = ("llama", "qwen2")
    expected = [M.hf_train(n, M.Run("plain"), steps=2, accumulate=1) for n in names]
    expected_state = [M.state_of(model) for model, _ in expected]
    models = [M.build(n) for n in names]

    def work(i: int) -> list[float]:
        return M.hf_train(names[i], M.Run("scope"), steps=2, accumulate=1, model=models[i])[1]

    with ThreadPoolExecutor(max_workers=2) as pool:
        losses = list(pool.map(work, range(2)))
    for i in range(2):
        assert losses[i] == expected[i][1], names[i]
        M.assert_same_state(models[i], expected_state[i])


@pytest.mark.parametrize("mode", M.MODES)
def test_asyncio_tasks_each_with_their_own_scopes(mode: str) -> None:
    models = _models()
    budget = _configure(mode, models)
    if budget is not None:
        M.LIVE_HANDLES.extend(ts.manage(m) for m in models)

    async def train(i: int) -> list[float]:
        model = models[i]
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for x, y in M.mlp_batches(STEPS, seed=10 + i):
            with ts.scope():
                out = model(x)
                await asyncio.sleep(0)  # the other tasks run their own scopes here
                loss = torch.nn.functional.mse_loss(out, y)
                optimizer.zero_grad()
                loss.backward()
                await asyncio.sleep(0)
                optimizer.step()
                losses.append(loss.item())
            await asyncio.sleep(0)
        return losses

    async def main() -> list[list[float]]:
        return list(await asyncio.gather(*(train(i) for i in range(WORKERS))))

    losses = asyncio.run(main())
    _check(models, losses, budget)


def test_asyncio_task_scopes_do_not_own_each_others_tensors() -> None:
    async def task(i: int, seen: dict[int, ts.DisposeScope | None]) -> torch.Tensor:
        with ts.scope() as scope:
            t = torch.full((2,), float(i)) * 1
            await asyncio.sleep(0)
            seen[i] = t.scope
            assert ts.current_scope() is scope
            await asyncio.sleep(0)
            return scope.move_to_outer(t)

    async def main() -> tuple[list[torch.Tensor], dict[int, ts.DisposeScope | None]]:
        seen: dict[int, ts.DisposeScope | None] = {}
        out = await asyncio.gather(*(task(i, seen) for i in range(WORKERS)))
        return list(out), seen

    outs, seen = asyncio.run(main())
    assert len({id(s) for s in seen.values()}) == WORKERS
    for i, t in enumerate(outs):
        assert not t.is_disposed and t.scope is None
        assert torch.equal(t, torch.full((2,), float(i)))
