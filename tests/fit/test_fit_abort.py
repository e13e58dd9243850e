"""An exception out of a fitted step aborts it (NOTE [an aborted step], docs/fit.md "Aborted
steps"): fit's own state is as if the step had not started and another model's fit is not
touched; with atomic=True parameters and optimizer state are as before the step, and training
goes on bit-identically to a plain run that skipped it; without it, the parameters updated
inside backward are named in a FitWarning."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.errors import FitWarning
from tensorscope.plan.hooks import tensors_in
from tensorscope.plan.mode import OPEN

from .fit_helpers import batches, differing, loss_of, optimizer, plain_peak, step, tiny, twin

Batch = dict[str, torch.Tensor]


class Boom(Exception):
    """An error of the user's code."""


def _raising(exc: BaseException) -> Callable[..., None]:
    def hook(*_: Any) -> None:
        raise exc

    return hook


def _in_forward(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    if "x" in batch:
        model(batch["x"][:, :15])  # a bad input shape
    else:
        model(input_ids=batch["input_ids"].float())  # ids of the wrong dtype


def _hook_in_backward(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    param = next(_blocks(model)[1].parameters())
    handle = param.register_hook(_raising(Boom("a hook in backward")))
    try:
        loss_of(model, batch).backward()
    finally:
        handle.remove()


def _interrupt_in_backward(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    """Ctrl-C mid-backward: a tensor hook on block 1's output (after the later blocks'
    backward) raises KeyboardInterrupt."""

    def on_output(module: nn.Module, args: Any, out: Any) -> None:
        next(tensors_in(out)).register_hook(_raising(KeyboardInterrupt()))

    handle = _blocks(model)[1].register_forward_hook(on_output)
    try:
        loss = loss_of(model, batch)
    finally:
        handle.remove()
    loss.backward()


def _in_optimizer_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> None:
    loss_of(model, batch).backward()
    handle = opt.register_step_pre_hook(_raising(Boom("a step pre-hook")))
    try:
        opt.step()
    finally:
        handle.remove()


RAISE: dict[str, Callable[[nn.Module, torch.optim.Optimizer, Batch], None]] = {
    "forward": _in_forward,
    "backward": _hook_in_backward,
    "interrupt": _interrupt_in_backward,
    "optimizer.step": _in_optimizer_step,
}


def _blocks(model: nn.Module) -> nn.ModuleList:
    found = getattr(model, "layers", None)
    return found if isinstance(found, nn.ModuleList) else model.transformer.h  # type: ignore[union-attr, return-value]


def _abort(
    where: str, model: nn.Module, opt: torch.optim.Optimizer, batch: Batch, seed: int
) -> None:
    """The step raises where it says; the user's loop catches it and lets the step go."""
    torch.manual_seed(seed)
    try:
        RAISE[where](model, opt, batch)
    except (Boom, RuntimeError, KeyboardInterrupt):
        opt.zero_grad()
    else:
        pytest.fail(f"the step did not raise in {where}")


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer state's tensors (read back where ts.fit keeps them in the next tier)."""
    values = [v for s in opt.state_dict()["state"].values() for v in s.values()]
    return [v.clone() for v in values if isinstance(v, torch.Tensor)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


_CLEAN: dict[str, tuple[int, int]] = {}


def _clean(name: str, budget: int, batch: Batch) -> tuple[int, int]:
    """The measured step of a fit of ``name`` with nothing aborted: its plan's ops and peak."""
    if name not in _CLEAN:
        model = tiny(name)
        opt = optimizer("sgd", model)
        fit = ts.fit(model, opt, budget=budget, atomic=True)
        step(model, opt, batch)
        assert fit.plan_before is not None
        _CLEAN[name] = (len(fit.plan_before.ops), fit.plan_before.peak_bytes)
        fit.remove()
    return _CLEAN[name]


Trained = tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]


def _train_two(where: str, at: int, first: Trained, second: Trained, data: list[Batch]) -> None:
    """Both models train on ``data``, the first's step ``at`` raising ``where``; their plain
    twins the same, the first's skipping that step. Weights end bit-identical."""
    a, opt_a, ref_a, ref_opt_a = first
    b, opt_b, ref_b, ref_opt_b = second
    for k, batch in enumerate(data):
        if k == at - 1:  # A's step `at` raises; B trains its step before A's is noticed
            params, states = [p.clone() for p in a.parameters()], _state(opt_a)
            _abort(where, a, opt_a, batch, seed=k)
            step(b, opt_b, batch, seed=100 + k)
            assert _same(params, list(a.parameters())) and _same(states, _state(opt_a))
        else:
            step(a, opt_a, batch, seed=k)
            step(b, opt_b, batch, seed=100 + k)
        step(ref_b, ref_opt_b, batch, seed=100 + k)
        if k != at - 1:
            step(ref_a, ref_opt_a, batch, seed=k)
    assert differing(a, ref_a) == [] and differing(b, ref_b) == []


@pytest.mark.parametrize("where", list(RAISE))
@pytest.mark.parametrize("at", [1, 3, 5])  # the measured step, the recorded one, a timed one
def test_an_aborted_step_touches_neither_its_fit_nor_another_models(where: str, at: int) -> None:
    budget = plain_peak("mlp", "sgd")
    stream = batches("mlp")
    data = [next(stream) for _ in range(7)]
    a, b = tiny("mlp"), tiny("mlp")
    b.head.weight.data.mul_(2)  # another model
    ref_a, ref_b = twin(a), twin(b)
    opt_a, opt_b = optimizer("sgd", a), optimizer("sgd", b)
    ref_opt_a, ref_opt_b = optimizer("sgd", ref_a), optimizer("sgd", ref_b)
    fit_a = ts.fit(a, opt_a, budget=budget, atomic=True)
    fit_b = ts.fit(b, opt_b, budget=budget)
    try:
        _train_two(where, at, (a, opt_a, ref_a, ref_opt_a), (b, opt_b, ref_b, ref_opt_b), data)
        assert fit_a.steps == len(data) - 1 and fit_b.steps == len(data)
        # A's fit as if the step had not started, B's as if A did not exist
        assert fit_a.plan_before is not None and fit_b.plan_before is not None
        ops, peak = _clean("mlp", budget, data[1])
        assert (len(fit_a.plan_before.ops), fit_a.plan_before.peak_bytes) == (ops, peak)
        assert len(fit_b.plan_before.ops) == ops  # the same shapes: the same ops
        assert fit_a.decision is not None and fit_b.decision is not None
        assert fit_a.grads_kept_because == [fit_a.grads_kept_because[0]]  # atomic=True's alone
        assert f"step {at}: aborted" in fit_a.explain()
        assert "aborted" not in "".join(fit_b.notes)
    finally:
        fit_a.remove()
        fit_b.remove()
    assert not OPEN and torch._C._len_torch_function_stack() == 0


def _interrupted_gpt2(atomic: bool) -> tuple[Any, ...]:
    """GPT-2 under AdamW, Ctrl-C mid-backward at step 4, then three more steps; its plain twin
    skipped step 4. Returns the model, twin, fit, the caught warnings, and the parameters and
    optimizer state just before step 4 and just after the interrupt was noticed."""
    model = tiny("gpt2")
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=int(plain_peak("gpt2", "adamw") * 1.1), atomic=atomic)
    stream = batches("gpt2")
    data = [next(stream) for _ in range(7)]
    for k in range(3):
        step(model, opt, data[k], seed=k)
    assert atomic or (fit.decision is not None and fit.decision.free_gradients)
    before = ([p.clone() for p in model.parameters()], _state(opt))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _abort("interrupt", model, opt, data[3], seed=3)
        assert not caught  # noticed later: at the next forward, step, explain() or remove()
        fit.explain()
    after = ([p.clone() for p in model.parameters()], _state(opt))
    for k in range(4, 7):
        step(model, opt, data[k], seed=k)
    for k in (0, 1, 2, 4, 5, 6):
        step(ref, ref_opt, data[k], seed=k)
    return model, ref, opt, ref_opt, fit, caught, before, after


def test_an_interrupted_backward_names_the_parameters_it_updated() -> None:
    model, _, _, _, fit, caught, before, after = _interrupted_gpt2(atomic=False)
    warned = [w for w in caught if issubclass(w.category, FitWarning)]
    assert len(warned) == 1
    text = str(warned[0].message)
    assert "step 4 was aborted" in text and "backward" in text
    names = [name for name, _ in model.named_parameters()]
    updated = [
        n for n, b, a in zip(names, before[0], after[0], strict=True) if not torch.equal(b, a)
    ]
    count = int(text.split(" after ")[1].split(" parameters")[0])
    assert count == len(updated) > 0
    for block in {n.rsplit(".", 3)[0] for n in updated if n.startswith("transformer.h.")}:
        assert block in text  # named by block
    assert "transformer.h.0 " not in text  # before the interrupt: not reached
    assert "step 4: aborted" in fit.explain() and fit.steps == 6
    fit.remove()


def test_atomic_steps_leave_weights_and_state_as_before_an_interrupt() -> None:
    model, ref, opt, ref_opt, fit, caught, before, after = _interrupted_gpt2(atomic=True)
    assert not [w for w in caught if issubclass(w.category, FitWarning)]
    assert _same(before[0], after[0]) and _same(before[1], after[1])
    assert differing(model, ref) == []
    assert _same(_state(opt), _state(ref_opt))
    text = fit.explain()
    assert "atomic=True: gradients kept until optimizer.step()" in text and "its cost" in text
    assert fit.decision is not None and not fit.decision.free_gradients
    fit.remove()


def test_an_interrupted_forward_is_noticed_at_the_next_one() -> None:
    model = tiny("mlp")
    ref = twin(model)
    opt, ref_opt = optimizer("sgd", model), optimizer("sgd", ref)
    fit = ts.fit(model, opt, budget=plain_peak("mlp", "sgd"))
    data = batches("mlp")
    step(model, opt, next(data), seed=0)
    step(ref, ref_opt, next(batches("mlp")), seed=0)
    handle = model.layers[2].register_forward_pre_hook(_raising(KeyboardInterrupt()))
    with contextlib.suppress(KeyboardInterrupt):
        step(model, opt, next(data), seed=1)
    handle.remove()
    assert torch._C._len_torch_function_stack() == 1  # the loss routing's, left by Ctrl-C
    assert "aborted" in fit.explain()  # noticed
    assert torch._C._len_torch_function_stack() == 0
    ref_data = batches("mlp")
    next(ref_data)
    next(ref_data)
    for k in range(2, 5):
        step(model, opt, next(data), seed=k)
        step(ref, ref_opt, next(ref_data), seed=k)
    assert differing(model, ref) == []
    assert fit.steps == 4 and "step 2: aborted (an exception propagated out of its forward)" in (
        fit.explain()
    )
    fit.remove()


def test_a_step_that_continues_after_a_caught_error_in_its_forward_is_a_new_step() -> None:
    model = tiny("mlp")
    opt = optimizer("sgd", model)
    fit = ts.fit(model, opt, budget=plain_peak("mlp", "sgd"))
    data = batches("mlp")
    with pytest.raises(RuntimeError):
        model(next(data)["x"][:, :15])
    assert fit.steps == 0 and "step 1: aborted" in fit.explain()
    assert fit.plan_before is None and not OPEN  # the recording was closed at once
    step(model, opt, next(data))
    assert fit.plan_before is not None and fit.steps == 1
    fit.remove()


def test_atomic_must_be_a_bool() -> None:
    model = tiny("mlp")
    with pytest.raises(ts.ArgumentTypeError, match="atomic"):
        ts.fit(model, optimizer("sgd", model), budget="64MiB", atomic="yes")  # type: ignore[arg-type]
    assert not model._forward_pre_hooks


def test_remove_in_the_middle_of_a_step_drops_it() -> None:
    model = tiny("mlp")
    opt = optimizer("sgd", model)
    fit = ts.fit(model, opt, budget=plain_peak("mlp", "sgd"))
    loss = loss_of(model, next(batches("mlp")))  # a step begun, its recording open
    assert OPEN
    fit.remove()
    assert not OPEN and "aborted" not in fit.explain()
    loss.backward()
    opt.step()  # plain again
    assert fit.steps == 0


class Outer(nn.Module):
    """A model whose forward calls another fitted model (fitted on its own)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))  # type: ignore[no-any-return]


def test_a_fitted_model_called_inside_another_ones_forward_aborts_nothing() -> None:
    budget = plain_peak("mlp", "sgd") * 2
    outer = Outer(tiny("mlp"))
    ref = twin(outer)
    runs = []
    for model in (outer, ref):
        opts = (optimizer("sgd", model.inner), torch.optim.SGD(model.head.parameters(), lr=0.1))
        runs.append((model, opts))
    fits = [ts.fit(outer.inner, runs[0][1][0], budget=budget)]
    fits.append(ts.fit(outer, runs[0][1][1], budget=budget))
    data = batches("mlp")
    try:
        for k in range(4):
            x = next(data)["x"]
            for model, (opt_inner, opt_head) in runs:
                torch.manual_seed(k)
                model(x).square().mean().backward()
                opt_head.step()
                opt_inner.step()
                opt_head.zero_grad()
                opt_inner.zero_grad()
        assert differing(outer, ref) == []
        assert [fit.steps for fit in fits] == [4, 4]
        assert not any("aborted" in note for fit in fits for note in fit.notes)
    finally:
        for fit in fits:
            fit.remove()


def test_a_closure_runs_its_forwards_inside_the_optimizer_step() -> None:
    model = tiny("mlp")
    ref = twin(model)
    opts = [torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=3) for m in (model, ref)]
    fit = ts.fit(model, opts[0], budget=plain_peak("mlp", "sgd") * 2)
    data = batches("mlp")
    try:
        for k in range(3):
            x = next(data)["x"]
            for m, opt in zip((model, ref), opts, strict=True):
                torch.manual_seed(k)

                def closure(
                    m: nn.Module = m, opt: torch.optim.Optimizer = opt, x: torch.Tensor = x
                ) -> torch.Tensor:
                    opt.zero_grad()
                    loss = m(x).square().mean()
                    loss.backward()
                    return loss

                opt.step(closure)  # type: ignore[arg-type]
        assert differing(model, ref) == []
        assert fit.steps == 3 and not any("aborted" in note for note in fit.notes)
        assert fit.decision is not None and any("LBFGS" in r for r in fit.grads_kept_because)
        handle = opts[0].register_step_post_hook(_raising(Boom("after the update")))
        with pytest.raises(Boom):  # the step began inside optimizer.step(), which raised
            opts[0].step(lambda: model(x).square().mean())
        handle.remove()
        assert "step 4: aborted (an exception propagated out of its optimizer.step())" in (
            fit.explain()
        )
        assert fit.steps == 3
    finally:
        fit.remove()


def _partway(after: int) -> Callable[..., None]:
    """A step pre-hook that raises partway through ``optimizer.step()``: at once for a whole
    step, at the ``after + 1``-th parameter's where ts.fit runs the step one parameter at a
    time (its hooks run for each: statestore.py)."""
    calls = [0]

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        calls[0] += 1
        if sum(len(g["params"]) for g in opt.param_groups) > 1 or calls[0] > after:
            raise Boom("partway through optimizer.step()")

    return hook


def _stepped_with_the_state_offloaded(atomic: bool) -> tuple[Any, ...]:
    """GPT-2 under AdamW with clipping (gradients kept) at a budget only the optimizer state in
    the next tier fits; step 4's optimizer.step() raises partway; then two more steps. The twin
    skipped step 4."""
    model = tiny("gpt2")
    ref = twin(model)
    opt, ref_opt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=int(1.6 * 2**20), atomic=atomic)
    stream = batches("gpt2")
    data = [next(stream) for _ in range(6)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(3):
            step(model, opt, data[k], clip=1.0, seed=k)
        store = fit._states.store
        assert store is not None and store.enabled and store.stepwise is not atomic
        before = ([p.clone() for p in model.parameters()], _state(opt))
        torch.manual_seed(3)
        loss_of(model, data[3]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        handle = opt.register_step_pre_hook(_partway(10))
        with pytest.raises(Boom):
            opt.step()
        handle.remove()
        opt.zero_grad()
        fit.explain()  # noticed
    after = ([p.clone() for p in model.parameters()], _state(opt))
    for k in range(4, 6):
        step(model, opt, data[k], clip=1.0, seed=k)
    for k in (0, 1, 2, 4, 5):
        step(ref, ref_opt, data[k], clip=1.0, seed=k)
    warned = [str(w.message) for w in caught if "was aborted" in str(w.message)]
    return model, ref, opt, ref_opt, fit, warned, before, after


def test_an_optimizer_step_run_one_parameter_at_a_time_names_what_it_updated() -> None:
    _, _, _, _, fit, warned, before, after = _stepped_with_the_state_offloaded(False)
    changed = sum(not torch.equal(b, a) for b, a in zip(before[0], after[0], strict=True))
    assert len(warned) == 1 and "out of its optimizer.step()" in warned[0]
    assert f"after {changed} parameters were already updated" in warned[0] and changed == 10
    fit.remove()


def test_atomic_steps_with_the_state_offloaded_leave_it_as_before() -> None:
    model, ref, opt, ref_opt, fit, warned, before, after = _stepped_with_the_state_offloaded(True)
    assert not warned
    assert _same(before[0], after[0]) and _same(before[1], after[1])
    assert differing(model, ref) == [] and _same(_state(opt), _state(ref_opt))
    assert fit._states.store is not None and fit._states.store.spilled_bytes > 0
    fit.remove()
