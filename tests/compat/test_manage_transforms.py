"""Model transforms after ``ts.manage()`` (issue 15): the module stays managed.

``model.half()``/``.to(dtype)``/``.float()``/``.double()``, ``torch.nn.utils.parametrize``,
``resize_token_embeddings`` and parameters, buffers or submodules assigned after ``manage()``:
every parameter, buffer and gradient of the module is managed afterwards (its bytes accounted
by the manager, the budget enforced), its values are those plain PyTorch gives, and
``remove()`` gives back plain tensors.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import tensorscope as ts

from . import _models as M

CONVERSIONS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "half": lambda m: m.half(),
    "to_bfloat16": lambda m: m.to(torch.bfloat16),
    "half_then_float": lambda m: m.half().float(),
    "double": lambda m: m.double(),
    "to_float64_keyword": lambda m: m.to(dtype=torch.float64),
    "float_noop": lambda m: m.float(),
    "to_cpu_noop": lambda m: m.to("cpu"),
}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and gradient of ``model``, by name."""
    found = dict(model.named_parameters())
    found.update(model.named_buffers())
    found.update({f"{n}.grad": p.grad for n, p in model.named_parameters() if p.grad is not None})
    return found


def _storage_bytes(tensors: dict[str, torch.Tensor]) -> int:
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()
    }
    return sum(storages.values())


def assert_all_managed(model: nn.Module, budget: int | None) -> None:
    """Every tensor of the module is managed, the manager accounts its bytes, the peak held."""
    tensors = _tensors(model)
    unmanaged = [n for n, t in tensors.items() if ts.residency.placement_of(t) is None]
    assert unmanaged == [], f"left unmanaged: {unmanaged}"
    for name, param in model.named_parameters():
        assert type(param) is ts.ManagedParameter, name
    report = ts.residency.report()
    accounted = sum(tier.resident_bytes for tier in report.tiers.values())
    assert accounted >= _storage_bytes(tensors)
    if budget is not None:
        assert report.peak_bytes <= budget, f"peak {report.peak_bytes} > budget {budget}"


def assert_plain_again(model: nn.Module) -> None:
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert all(type(b) is torch.Tensor for b in model.buffers())
    assert ts.residency.managed_count() == 0


def _with_grads(model: nn.Module) -> nn.Module:
    x, y = M.mlp_batches(1, seed=4)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    return model


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_a_conversion_after_manage_keeps_parameters_buffers_and_grads_managed(
    conversion: str,
) -> None:
    plain = _with_grads(M.mlp(batchnorm=True))
    model = _with_grads(M.mlp(batchnorm=True))
    doubles = conversion in ("double", "to_float64_keyword")  # every size doubles
    budget = M.budget_for(model) * (2 if doubles else 1)
    ts.residency.configure(device="cpu", policy="flow", budget=budget)
    handle = ts.manage(model)
    ts.residency.report(reset=True)
    plain = CONVERSIONS[conversion](plain)
    model = CONVERSIONS[conversion](model)
    assert_all_managed(model, budget)
    expected = _tensors(plain)
    for name, value in _tensors(model).items():
        assert value.dtype == expected[name].dtype, name
        assert torch.equal(value, expected[name]), name
    # It trains on like plain, under the budget.
    dtype = next(plain.parameters()).dtype
    batches = [(x.to(dtype), y.to(dtype)) for x, y in M.mlp_batches(2, seed=3)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = M.mlp_train(model, batches, ts.scope, optimizer=optimizer)
    plain_losses = M.mlp_train(
        plain, batches, M.Run("plain").step, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1)
    )
    assert losses == plain_losses
    assert_all_managed(model, budget)
    handle.remove()
    assert_plain_again(model)
    M.assert_same_state(model, M.state_of(plain))


def test_a_conversion_inside_a_scope_after_manage() -> None:
    plain = M.mlp(batchnorm=True).half()
    model = M.mlp(batchnorm=True)
    budget = M.budget_for(model)
    ts.residency.configure(device="cpu", policy="genoa", budget=budget)
    handle = ts.manage(model)
    with ts.scope():
        model.half()
    assert_all_managed(model, budget)
    M.assert_same_state(model, M.state_of(plain))
    handle.remove()
    assert_plain_again(model)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_a_transformers_model_converted_after_manage_runs_like_plain(name: str) -> None:
    batch = M.batch(name, 0)
    plain = M.build(name).eval().to(torch.bfloat16)
    with torch.no_grad():
        expected = plain(**batch).logits
    model = M.build(name).eval()
    run = M.Run("flow")
    run.manage(model)
    model.to(torch.bfloat16)
    assert_all_managed(model, run.budget)
    with torch.no_grad(), ts.scope():
        logits = M.plain_copy(model(**batch).logits)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, expected)
    run.check_budget()


# ------------------------------------------------------------------------------ parametrize
class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


PARAMETRIZATIONS: dict[str, Callable[[nn.Linear], object]] = {
    "orthogonal": lambda layer: parametrizations.orthogonal(layer),
    "weight_norm": lambda layer: parametrizations.weight_norm(layer),
    "spectral_norm": lambda layer: parametrizations.spectral_norm(layer),
    "custom": lambda layer: parametrize.register_parametrization(layer, "weight", Symmetric()),
}


BUDGET = 48 * 1024


def _parametrized(kind: str, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 128),
        nn.Tanh(),
        nn.Linear(128, 32),
        nn.Tanh(),
        nn.Linear(32, 32),  # parametrized
        nn.Tanh(),
        nn.Linear(32, 128),
        nn.Tanh(),
        nn.Linear(128, 4),
    )


@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_a_parametrization_after_manage_trains_like_plain(kind: str) -> None:
    plain = _parametrized(kind)
    PARAMETRIZATIONS[kind](plain[4])  # type: ignore[arg-type]
    model = _parametrized(kind)
    # Weights 47 KiB, and as much again of gradients.
    ts.residency.configure(device="cpu", policy="flow", budget=BUDGET)
    handle = ts.manage(model)
    PARAMETRIZATIONS[kind](model[4])  # type: ignore[arg-type]
    # The original (and weight_norm's new g) are managed parameters of the module.
    originals = dict(model[4].parametrizations.weight.named_parameters())
    assert originals and all(type(p) is ts.ManagedParameter for p in originals.values())
    assert all(type(v) is torch.Tensor for v in model.state_dict().values())  # plain detach
    batches = M.mlp_batches(3, seed=5)

    def train(m: nn.Module, step: Callable[[], object]) -> list[float]:
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        return M.mlp_train(m, batches, step, optimizer=optimizer)  # type: ignore[arg-type]

    assert train(model, ts.scope) == train(plain, M.Run("plain").step)
    assert_all_managed(model, BUDGET)
    assert ts.residency.report().transfers.count > 0  # the budget did bind
    for (key, ours), theirs in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(ours, theirs), key
    handle.remove()
    assert_plain_again(model)
    parametrize.remove_parametrizations(model[4], "weight")
    parametrize.remove_parametrizations(plain[4], "weight")
    assert torch.equal(model[4].weight, plain[4].weight)


# ---------------------------------------------------------------- tensors added or replaced
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_resize_token_embeddings_after_manage_then_generate(name: str) -> None:
    plain = M.build(name).eval()
    torch.manual_seed(3)
    plain.resize_token_embeddings(M.VOCAB + 32)
    expected = M.generate_ids(plain, name, "greedy", M.Run("plain"))
    model = M.build(name).eval()
    run = M.Run("flow")
    run.manage(model)
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.ResidencyWarning)
        model.resize_token_embeddings(M.VOCAB + 32)
    embedding = model.get_input_embeddings().weight
    assert embedding.shape[0] == M.VOCAB + 32 and embedding.tier in ("device", "disk")
    assert_all_managed(model, run.budget)
    assert M.generate_ids(model, name, "greedy", run) == expected
    run.check_budget()


def test_parameters_buffers_and_modules_assigned_after_manage_are_managed() -> None:
    model = M.mlp(depth=8)
    budget = M.budget_for(model)
    ts.residency.configure(device="cpu", policy="flow", budget=budget)
    handle = ts.manage(model)
    model[0].weight = nn.Parameter(torch.ones(32, 16))  # replaced
    model.register_buffer("scale", torch.full((4,), 2.0))  # added
    model.add_module("extra", nn.Linear(4, 4))  # a new submodule
    model[2].weight.data = torch.zeros(32, 32)  # .data replaced
    state = copy.deepcopy(model[4].state_dict())
    model[4].load_state_dict({k: v + 1 for k, v in state.items()}, assign=True)
    assert_all_managed(model, budget)
    assert torch.equal(model[0].weight, torch.ones(32, 16))
    assert torch.equal(model[2].weight, torch.zeros(32, 32))
    assert torch.equal(model[4].bias, state["bias"] + 1)
    # Written straight into a module's dict, nothing sees it: refresh() manages it.
    model[4]._parameters["bias"] = nn.Parameter(torch.zeros(4))
    assert handle.refresh() == ["4.bias"]
    assert_all_managed(model, budget)
    # One that cannot be managed is named, with how to fix it.
    with pytest.warns(ts.ResidencyWarning, match=r"extra\.weight .*meta device.*refresh"):
        model.extra.weight = nn.Parameter(torch.empty(4, 4, device="meta"))
    handle.remove()
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_a_dropped_handle_still_watches_and_nothing_keeps_the_model_alive() -> None:
    import gc
    import weakref

    model = M.mlp(depth=2)
    ts.residency.configure(device="cpu", policy="flow", budget=M.budget_for(M.mlp(depth=8)))
    ts.manage(model)  # the handle is not kept
    model.half()
    assert_all_managed(model, None)
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None  # neither the handle nor the watch keeps the module alive
    ts.residency.report()  # sweeps what nothing holds any more
    assert ts.residency.managed_count() == 0
