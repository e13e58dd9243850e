"""ts.fit with the optimizer state in the next tier between updates (the disk tier on a CPU
device): chosen when the budget needs it, weights and optimizer state bit-identical to the plain
loop, the state on disk between steps, state_dict/load_state_dict/remove whole."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch

import tensorscope as ts
from tensorscope.errors import FitWarning, ResidencyError
from tensorscope.fit.statestore import MIN_SPILL_BYTES, StateStore

from .fit_helpers import batches, differing, optimizer, step, tight_state_budget, tiny, twin

pytestmark = [
    pytest.mark.engine_independent,  # ts.fit outside scopes (checked)
    pytest.mark.strict,  # moves data through the device backend (tests/conftest.py)
]


def _state_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, value in sb[k].items():
            assert torch.equal(sa[k][key], value), (k, key)


@pytest.mark.parametrize(
    ("name", "kind", "clip"),
    [
        ("gpt2", "adamw", None),
        ("gpt2", "adamw", 1.0),
        ("llama", "adamw", None),
        ("mlp", "sgd", None),
    ],
)
def test_state_offloaded_when_only_that_fits(name: str, kind: str, clip: float | None) -> None:
    budget = tight_state_budget(name, kind, clip)
    model = tiny(name)
    ref = twin(model)
    opt, ropt = optimizer(kind, model), optimizer(kind, ref)
    fit = ts.fit(model, opt, budget=budget)
    mine, theirs = batches(name), batches(name)
    for i in range(5):
        assert step(model, opt, next(mine), seed=i, clip=clip) == step(
            ref, ropt, next(theirs), seed=i, clip=clip
        )
        assert not differing(model, ref)
        if i == 0:
            continue
        # between steps every tensor of state is a placeholder; its bytes are in the store
        values = [v for s in opt.state.values() for v in s.values() if v.nbytes >= MIN_SPILL_BYTES]
        assert values and all(v.device.type == "meta" for v in values)
        assert fit._states.store is not None
        assert fit._states.store.spilled_bytes == sum(v.nbytes for v in values)
    d = fit.decision
    assert d is not None and d.chosen.base.state_offloaded
    assert d.free_gradients is (clip is None)
    assert not any(c.fits for c in d.candidates if not c.base.state_offloaded)
    assert fit.plan_after is not None and fit.plan_after.peak_bytes <= budget
    below = ts.residency.tiers[1]  # the tier below the CPU's backend: "disk"
    assert f"optimizer state in the {below} tier between updates" in fit.explain()
    _state_equal(opt, ropt)  # state_dict() reads the state back, bit for bit
    fit.remove()
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    for i in range(5, 7):  # plain again, still the same
        assert step(model, opt, next(mine), seed=i) == step(ref, ropt, next(theirs), seed=i)
    assert not differing(model, ref)
    _state_equal(opt, ropt)


def test_state_dict_between_steps_keeps_its_tensors_and_load_state_dict_goes_on() -> None:
    budget = tight_state_budget("gpt2", "adamw", None)
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    mine, theirs = batches("gpt2"), batches("gpt2")
    for i in range(3):
        step(model, opt, next(mine), seed=i)
        step(ref, ropt, next(theirs), seed=i)
    saved = opt.state_dict()
    step(model, opt, next(mine), seed=3)  # writes the state out again: saved stays whole
    step(ref, ropt, next(theirs), seed=3)
    assert all(v.device.type == "cpu" for s in saved["state"].values() for v in s.values())
    # the fitted optimizer takes the plain one's state after step 3 and goes on
    opt.load_state_dict(copy.deepcopy(ropt.state_dict()))  # torch's load shares tensors
    model.load_state_dict(ref.state_dict())
    for i in range(4, 7):
        assert step(model, opt, next(mine), seed=i) == step(ref, ropt, next(theirs), seed=i)
    assert not differing(model, ref)
    _state_equal(opt, ropt)
    fit.remove()


def test_a_failed_write_leaves_the_state_in_memory_and_warns() -> None:
    lin = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(2, 64)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[lin.weight].items()}
    store = StateStore(opt)
    store.enabled = True

    class Full:
        tier = "disk"

        def begin(self, storage: object) -> None:
            return None

        def finish(self, storage: object, started: object) -> None:
            raise ResidencyError("disk full (simulated)")

    store._stores[lin.weight.device] = Full()  # type: ignore[assignment]
    with pytest.warns(FitWarning, match="disk full"):
        store.after_step()
    assert store.write_errors == 1 and "disk full (simulated)" in store.off
    for key, value in opt.state[lin.weight].items():
        assert value.device.type == "cpu" and torch.equal(value, before[key])
    store._stores.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.after_step()  # NOTE [a full disk]: no more tries, no second warning
    assert opt.state[lin.weight]["exp_avg"].device.type == "cpu"
    assert store.measure(lin.weight.device) is None  # the fit decides without this tier
    store.close()
    assert torch.equal(opt.state[lin.weight]["exp_avg"], before["exp_avg"])


@pytest.mark.engine_dependent  # scopes or ts.manage
def test_a_managed_model_keeps_its_optimizer_state_with_the_residency_manager() -> None:
    # ts.manage places optimizer state made for managed parameters itself: ts.fit must not
    # also move it (its bytes may be on the manager's disk tier, not at data_ptr())
    budget = int(tight_state_budget("gpt2", "adamw", None) * 1.3)
    ts.residency.configure(device="cpu", policy="flow", budget="400KiB", offload_dir=None)
    try:
        model = tiny("gpt2")
        ref = twin(model)
        handle = ts.manage(model)
        opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
        fit = ts.fit(model, opt, budget=budget)
        mine, theirs = batches("gpt2"), batches("gpt2")
        for i in range(4):
            assert step(model, opt, next(mine), seed=i) == step(ref, ropt, next(theirs), seed=i)
        assert fit.decision is not None
        assert not any(c.base.state_offloaded for c in fit.decision.candidates)
        assert "managed by ts.manage" in fit.explain()
        fit.remove()
        handle.remove()
        assert not differing(model, ref)
    finally:
        ts.residency.configure(device="cpu", policy="flow", budget=None, offload_dir=None)


@pytest.mark.parametrize(
    ("make", "per_element"),
    [
        (lambda ps: torch.optim.AdamW(ps), 2),
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), 3),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
        (lambda ps: torch.optim.RMSprop(ps, momentum=0.5, centered=True), 3),
    ],
)
def test_the_first_step_floor_is_the_state_the_first_step_makes(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], per_element: int
) -> None:
    from tensorscope.fit.statestore import first_step_floor

    model = tiny("gpt2")
    opt = make(list(model.parameters()))
    params, grads, state = first_step_floor(opt)
    weights = sum(p.nbytes for p in model.parameters())
    assert (params, grads, state) == (weights, weights, per_element * weights)
    step(model, opt, next(batches("gpt2")))
    made = sum(
        v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    scalars = sum(1 for s in opt.state.values() for v in s.values() if v.dim() == 0)
    assert made - scalars * 4 == state  # the estimate, less the scalar `step` counters
    assert first_step_floor(opt)[2] == made  # made state counts as it is


def test_a_budget_the_first_step_cannot_meet_is_said_before_it_runs() -> None:
    model = tiny("gpt2")
    opt = optimizer("adamw", model)
    weights = sum(p.nbytes for p in model.parameters())
    with pytest.warns(FitWarning, match="first step, recorded to measure") as seen:
        fit = ts.fit(model, opt, budget=4 * weights - 1)
    message = str(seen[0].message)
    assert "optimizer state" in message and "above the budget" in message
    fit.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FitWarning)
        ts.fit(model, opt, budget=4 * weights).remove()
