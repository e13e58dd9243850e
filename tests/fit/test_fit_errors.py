"""ts.fit's bad inputs and lifecycle: clear errors, no partial state, nothing of the model lost."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks

import tensorscope as ts

from .fit_helpers import batches, differing, optimizer, plain_peak, step, tiny, twin

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


def test_nothing_runs_at_the_call_and_remove_gives_everything_back() -> None:
    model = tiny("gpt2")
    opt = optimizer("adamw", model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dicts = [dict(m.__dict__) for m in model.modules()]
    hooks_before = len(_global_optimizer_post_hooks)
    fit = ts.fit(model, opt, budget="64MiB")
    assert fit.plan_before is None and fit.decision is None and fit.steps == 0
    fit.remove()
    fit.remove()  # idempotent
    assert [dict(m.__dict__) for m in model.modules()] == dicts
    assert not model._forward_pre_hooks and not opt._optimizer_step_post_hooks
    assert len(_global_optimizer_post_hooks) == hooks_before
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "[removed]" in fit.explain()


def test_remove_after_training_leaves_a_plain_model() -> None:
    model = tiny("mlp")
    ref = twin(model)
    opt, ref_opt = optimizer("sgd", model), optimizer("sgd", ref)
    fit = ts.fit(model, opt, budget=int(plain_peak("mlp", "sgd") * 0.6))
    data, ref_data = batches("mlp"), batches("mlp")
    for k in range(4):
        step(model, opt, next(data), seed=k)
        step(ref, ref_opt, next(ref_data), seed=k)
    fit.remove()
    for block in model.layers:
        assert "forward" not in block.__dict__
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # type: ignore[attr-defined]
    for k in range(4, 6):  # plain training afterwards, still equal
        assert step(model, opt, next(data), seed=k) == step(ref, ref_opt, next(ref_data), seed=k)
    assert differing(model, ref) == []
    assert opt.state_dict()["state"].keys() == ref_opt.state_dict()["state"].keys()


def test_fit_twice_on_one_model_or_optimizer_is_refused() -> None:
    model = tiny("mlp")
    opt = optimizer("sgd", model)
    fit = ts.fit(model, opt, budget="64MiB")
    with pytest.raises(ts.InvalidArgumentError, match="already fitted"):
        ts.fit(model, optimizer("sgd", model), budget="64MiB")
    with pytest.raises(ts.InvalidArgumentError, match="already fitted"):
        ts.fit(tiny("mlp"), opt, budget="64MiB")
    fit.remove()
    ts.fit(model, opt, budget="64MiB").remove()  # after remove(): allowed again


def test_bad_arguments() -> None:
    model = tiny("mlp")
    opt = optimizer("sgd", model)
    with pytest.raises(ts.InvalidArgumentError, match="budget"):
        ts.fit(model, opt, budget="12 parsecs")
    with pytest.raises(ts.ArgumentTypeError):
        ts.fit(model, "adam", budget="1GiB")  # type: ignore[arg-type]
    with pytest.raises(ts.ArgumentTypeError):
        ts.fit("model", opt, budget="1GiB")  # type: ignore[arg-type]
    hf = tiny("gpt2")
    hf.gradient_checkpointing_enable()  # type: ignore[operator]
    with pytest.raises(ts.InvalidArgumentError, match="gradient_checkpointing_disable"):
        ts.fit(hf, optimizer("sgd", hf), budget="1GiB")
    assert not model._forward_pre_hooks


def test_a_budget_nothing_meets_names_the_smallest_that_fits() -> None:
    model = tiny("gpt2")
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget="64KiB")
    data = batches("gpt2")
    with pytest.raises(ts.ScheduleError, match="smallest budget that fits") as info:
        step(model, opt, next(data))
    with pytest.raises(ts.ScheduleError):  # and at every later training forward
        step(model, opt, next(data))
    assert "no plan" in fit.explain()
    fit.remove()
    least = int(re.findall(r"\((\d+) bytes\)", str(info.value))[1])
    again = tiny("gpt2")
    ref = twin(again)
    opt, ref_opt = optimizer("adamw", again), optimizer("adamw", ref)
    fit = ts.fit(again, opt, budget=least)
    data, ref_data = batches("gpt2"), batches("gpt2")
    for k in range(4):
        assert step(again, opt, next(data), seed=k) == step(ref, ref_opt, next(ref_data), seed=k)
    assert differing(again, ref) == []
    assert fit.plan_after is not None and fit.plan_after.peak_bytes <= least
    fit.remove()


def test_a_model_without_a_block_chain_still_frees_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget="8MiB")
    g = torch.Generator().manual_seed(0)
    for k in range(4):
        x = torch.randn(128, 64, generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            torch.manual_seed(k)
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert differing(model, ref) == []
    assert fit.chain is None and fit.decision is not None and fit.decision.free_gradients
    text = fit.explain()
    assert "no block chain" in text and "nothing is recomputed" in text
    fit.remove()


class MySGD(torch.optim.SGD):
    """An optimizer ts.fit does not know (a subclass may override step)."""


def test_an_unknown_optimizer_is_treated_conservatively() -> None:
    model = tiny("mlp")
    ref = twin(model)
    opt = MySGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = MySGD(ref.parameters(), lr=0.05, momentum=0.9)
    fit = ts.fit(model, opt, budget=int(plain_peak("mlp", "sgd") * 0.8))
    data, ref_data = batches("mlp"), batches("mlp")
    for k in range(4):
        assert step(model, opt, next(data), seed=k) == step(ref, ref_opt, next(ref_data), seed=k)
    assert differing(model, ref) == []
    assert fit.decision is not None and not fit.decision.free_gradients
    assert "MySGD is not an optimizer ts.fit knows" in fit.explain()
    fit.remove()


def test_gradient_accumulation_keeps_gradients() -> None:
    model = tiny("mlp")
    ref = twin(model)
    opt, ref_opt = optimizer("sgd", model), optimizer("sgd", ref)
    fit = ts.fit(model, opt, budget=int(plain_peak("mlp", "sgd") * 0.9))
    data = batches("mlp")
    for k in range(3):
        micro = [next(data), next(data)]
        for m, o in ((model, opt), (ref, ref_opt)):
            torch.manual_seed(k)
            for batch in micro:
                (m(batch["x"]).square().mean() / 2).backward()
            o.step()
            o.zero_grad()
    assert differing(model, ref) == []
    assert fit.decision is not None and not fit.decision.free_gradients
    assert "gradient accumulation: 2 forwards" in fit.explain()
    fit.remove()


def test_a_larger_batch_is_measured_and_decided_again() -> None:
    budget = int(plain_peak("gpt2", "adamw", seq=24) * 1.2)
    model = tiny("gpt2")
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    small, big = batches("gpt2", seq=24), batches("gpt2", seq=40)
    small_ref, big_ref = batches("gpt2", seq=24), batches("gpt2", seq=40)
    for k in range(3):
        assert step(model, opt, next(small), seed=k) == step(ref, ref_opt, next(small_ref), seed=k)
    first = fit.decision
    for k in range(3, 7):
        assert step(model, opt, next(big), seed=k) == step(ref, ref_opt, next(big_ref), seed=k)
    assert differing(model, ref) == []
    assert fit.decision is not first
    assert any("the batch grew" in note for note in fit.notes)
    assert fit.plan_after is not None and fit.plan_after.peak_bytes <= budget
    fit.remove()


def test_a_model_dropped_without_remove_takes_its_hooks_along() -> None:
    import gc

    from tensorscope.plan import hooks as plan_hooks

    before = len(_global_optimizer_post_hooks), len(plan_hooks._users)
    model = tiny("mlp")
    fit = ts.fit(model, optimizer("sgd", model), budget="64MiB")
    del model, fit
    gc.collect()
    assert (len(_global_optimizer_post_hooks), len(plan_hooks._users)) == before


def test_gradients_kept_across_steps_turn_freeing_off() -> None:
    model = tiny("mlp")
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=int(plain_peak("mlp", "adamw") * 1.5))
    data = batches("mlp")
    for k in range(4):
        batch = next(data)
        for m, o in ((model, opt), (ref, ref_opt)):
            torch.manual_seed(k)
            m(batch["x"]).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=False)  # gradients stay, as zeros
    assert differing(model, ref) == []
    assert all(p.grad is not None for p in model.parameters())
    assert fit.decision is not None and not fit.decision.free_gradients
    assert "gradients existed when a step began" in fit.explain()
    fit.remove()


def test_a_grad_scaler_keeps_gradients_and_says_why() -> None:
    model = tiny("mlp")
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    scaler, ref_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    fit = ts.fit(model, opt, budget="64MiB")
    data = batches("mlp")
    for k in range(4):
        batch = next(data)
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            torch.manual_seed(k)
            s.scale(m(batch["x"]).square().mean()).backward()
            s.step(o)
            s.update()
            o.zero_grad()
    assert differing(model, ref) == []
    assert fit.decision is not None and not fit.decision.free_gradients
    assert "unscale" in fit.explain()
    fit.remove()


@pytest.mark.engine_dependent  # its subprocess imports tensorscope under the engine of the run
def test_import_tensorscope_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tensorscope as ts; "
        "assert callable(ts.fit); "
        "assert 'tensorscope.fit.handle' not in sys.modules; "
        "assert not any(m.startswith('transformers') for m in sys.modules); "
        "assert ts.Fit.__name__ == 'Fit'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
