"""ts.fit in threads (each thread trains its own model) and with DataLoader workers: the same
weights as the plain loop; each thread's decision and loss routing are its own."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import tensorscope as ts

from .fit_helpers import batches, differing, optimizer, plain_peak, step, tiny, twin

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    # torch's generator is global: two threads drawing dropout masks would interleave
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    return model


def _train(name: str, budget: int, out: dict[str, Any]) -> None:
    fit = None
    try:
        model = _no_dropout(tiny(name))
        ref = twin(model)
        opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
        fit = ts.fit(model, opt, budget=budget)
        mine, theirs = batches(name), batches(name)
        for i in range(4):
            out.setdefault("losses", []).append(
                (step(model, opt, next(mine), seed=i), step(ref, ropt, next(theirs), seed=i))
            )
        out["differing"] = differing(model, ref)
        out["decided"] = fit.decision is not None
    except BaseException as exc:  # reported by the main thread
        out["error"] = exc
    finally:
        if fit is not None:
            fit.remove()


def test_two_threads_fit_their_own_models() -> None:
    budgets = {name: int(plain_peak(name, "adamw") * 0.6) for name in ("gpt2", "llama")}
    results: dict[str, dict[str, Any]] = {name: {} for name in budgets}
    threads = [
        threading.Thread(target=_train, args=(name, budgets[name], results[name]))
        for name in budgets
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for name, out in results.items():
        assert "error" not in out, (name, out.get("error"))
        assert all(a == b for a, b in out["losses"]), (name, out["losses"])
        assert out["differing"] == [] and out["decided"], name


def test_fits_made_and_removed_while_another_thread_is_inside_its_step() -> None:
    # torch iterates its global step hooks while calling them: a hook added or removed by
    # another thread there fails that step ("OrderedDict mutated during iteration")
    inside, leave = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def wait_inside_the_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.current_thread() is worker:
            inside.set()
            leave.wait(60)

    def plain_steps() -> None:
        try:
            model = torch.nn.Linear(8, 8)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    handles = [
        register_optimizer_step_post_hook(wait_inside_the_step),
        register_optimizer_step_post_hook(lambda *_: None),  # the iteration goes on after it
    ]
    worker = threading.Thread(target=plain_steps)
    try:
        worker.start()
        assert inside.wait(60)
        model = tiny("gpt2")
        opt = optimizer("adamw", model)
        fit = ts.fit(model, opt, budget=int(plain_peak("gpt2", "adamw") * 0.6))
        step(model, opt, next(batches("gpt2")), seed=0)  # records, decides, applies
        fit.remove()
        with ts.record():
            pass
    finally:
        leave.set()
        worker.join(60)
        for handle in handles:
            handle.remove()
    assert not errors, errors


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 97, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def test_dataloader_workers_feed_a_fitted_model() -> None:
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=int(plain_peak("gpt2", "adamw") * 0.6))
    loader = torch.utils.data.DataLoader(_Tokens(), batch_size=4, num_workers=2)
    for i, batch in enumerate(loader):
        assert step(model, opt, batch, seed=i) == step(ref, ropt, batch, seed=i)
    assert not differing(model, ref)
    assert fit.decision is not None and fit.plan_after is not None
    fit.remove()
