"""Training loops inside dispose scopes train exactly as without them (API.md §2).

Parameters, buffers, ``.grad`` and optimizer state are never disposed by a scope, even when they
are created inside one (a model built in a scope, Adam's state made by the first ``step()``
inside a scope, ``.grad`` first made by a backward inside a scope). Every comparison is
bit-for-bit (``torch.equal``) against the same seeded loop run without scopes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorscope as ts

IN, HIDDEN, OUT = 8, 16, 4

Batches = list[tuple[torch.Tensor, torch.Tensor]]
OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
}
optimizers = pytest.mark.parametrize(
    "make_optimizer", list(OPTIMIZERS.values()), ids=list(OPTIMIZERS)
)


def make_model(*, batchnorm: bool = False) -> nn.Sequential:
    """A small seeded MLP (optionally with BatchNorm)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(IN, HIDDEN)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(HIDDEN))
    layers += [nn.ReLU(), nn.Linear(HIDDEN, OUT)]
    return nn.Sequential(*layers)


def make_batches(n: int, batch: int = 6) -> Batches:
    """Seeded data, made outside any scope (plain tensors)."""
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(batch, IN, generator=generator), torch.randn(batch, OUT, generator=generator))
        for _ in range(n)
    ]


def step_scope(scoped: bool) -> contextlib.AbstractContextManager[object]:
    return ts.scope() if scoped else contextlib.nullcontext()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Batches,
    *,
    scoped: bool,
    accumulate: int = 1,
    set_to_none: bool = True,
) -> list[float]:
    """The plain loop; with ``scoped`` each step (zero_grad, forward, backward, step) is scoped.

    With ``accumulate`` > 1 the gradients of that many consecutive batches, each in its own
    scope, are summed before one optimizer step.
    """
    losses = []
    for i, (x, y) in enumerate(batches):
        with step_scope(scoped):
            if i % accumulate == 0:
                optimizer.zero_grad(set_to_none=set_to_none)
            loss = F.mse_loss(model(x), y) / accumulate
            loss.backward()
            if (i + 1) % accumulate == 0:
                optimizer.step()
            losses.append(loss.item())
    return losses


def assert_alive(t: torch.Tensor) -> None:
    assert not getattr(t, "is_disposed", False)
    t.sum()  # raises if the data is gone


def assert_same_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    reference: nn.Module,
    reference_optimizer: torch.optim.Optimizer,
) -> None:
    """Parameters, grads, buffers and optimizer state are alive and bit-identical."""
    params = list(model.named_parameters())
    ref_params = list(reference.named_parameters())
    assert [n for n, _ in params] == [n for n, _ in ref_params]
    for (name, p), (_, q) in zip(params, ref_params, strict=True):
        assert_alive(p)
        assert isinstance(p, nn.Parameter), name
        assert p.requires_grad, name
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_alive(p.grad)
            assert torch.equal(p.grad, q.grad), name
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert_alive(b)
        assert torch.equal(b, c), name
    for (name, p), (_, q) in zip(params, ref_params, strict=True):
        state, ref_state = optimizer.state[p], reference_optimizer.state[q]
        assert sorted(state) == sorted(ref_state), name
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert_alive(value)
                assert torch.equal(value, ref_state[key]), f"{name}.{key}"
            else:
                assert value == ref_state[key], f"{name}.{key}"


def reference_run(
    make_optimizer: OptimizerFactory, batches: Batches, **kwargs: object
) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    model = make_model(batchnorm=bool(kwargs.pop("batchnorm", False)))
    optimizer = make_optimizer(model.parameters())
    losses = train(model, optimizer, batches, scoped=False, **kwargs)  # type: ignore[arg-type]
    return model, optimizer, losses


# --------------------------------------------------------------------------------------------


@optimizers
def test_scoped_training_matches_unscoped(make_optimizer: OptimizerFactory) -> None:
    """A scope around each step changes nothing: same losses, parameters, grads and state."""
    batches = make_batches(5)
    reference, reference_optimizer, reference_losses = reference_run(make_optimizer, batches)

    model = make_model()
    optimizer = make_optimizer(model.parameters())
    losses = train(model, optimizer, batches, scoped=True)

    assert losses == reference_losses
    assert_same_state(model, optimizer, reference, reference_optimizer)


@optimizers
def test_gradient_accumulation_across_scopes(make_optimizer: OptimizerFactory) -> None:
    """Gradients summed over several scopes (one backward each) equal the unscoped sum."""
    batches = make_batches(6)
    reference, reference_optimizer, reference_losses = reference_run(
        make_optimizer, batches, accumulate=3
    )

    model = make_model()
    optimizer = make_optimizer(model.parameters())
    losses = train(model, optimizer, batches, scoped=True, accumulate=3)

    assert losses == reference_losses
    assert_same_state(model, optimizer, reference, reference_optimizer)


@pytest.mark.parametrize("name", ["sgd-momentum", "adam"])
def test_gradient_accumulation_with_grads_zeroed_in_place(name: str) -> None:
    """``zero_grad(set_to_none=False)`` zeroes the surviving grads in place, across scopes."""
    make_optimizer = OPTIMIZERS[name]
    batches = make_batches(6)
    reference, reference_optimizer, _ = reference_run(
        make_optimizer, batches, accumulate=2, set_to_none=False
    )

    model = make_model()
    optimizer = make_optimizer(model.parameters())
    train(model, optimizer, batches, scoped=True, accumulate=2, set_to_none=False)

    assert_same_state(model, optimizer, reference, reference_optimizer)


def test_accumulated_grad_survives_each_scope() -> None:
    """``.grad`` first made by a backward inside a scope outlives it and keeps accumulating."""
    batches = make_batches(3)
    reference = make_model()
    model = make_model()
    for p in model.parameters():
        assert p.grad is None
    for x, y in batches:
        F.mse_loss(reference(x), y).backward()
        with ts.scope():
            F.mse_loss(model(x), y).backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad is not None
            assert_alive(p.grad)
            assert torch.equal(p.grad, q.grad)


@optimizers
def test_model_and_optimizer_built_inside_a_scope(make_optimizer: OptimizerFactory) -> None:
    """Parameters made inside a scope are never disposed; the model trains as usual."""
    batches = make_batches(4)
    reference, reference_optimizer, reference_losses = reference_run(make_optimizer, batches)

    with ts.scope():
        model = make_model()
        optimizer = make_optimizer(model.parameters())
    for p in model.parameters():
        assert_alive(p)
    losses = train(model, optimizer, batches, scoped=True)

    assert losses == reference_losses
    assert_same_state(model, optimizer, reference, reference_optimizer)


@pytest.mark.parametrize("name", ["adam", "adam-foreach"])
def test_first_optimizer_step_inside_a_scope_keeps_its_state(name: str) -> None:
    """Adam's state, created by the first ``step()`` inside a scope, survives the scope."""
    make_optimizer = OPTIMIZERS[name]
    batches = make_batches(4)
    reference, reference_optimizer, _ = reference_run(make_optimizer, batches)

    model = make_model()
    optimizer = make_optimizer(model.parameters())
    train(model, optimizer, batches[:1], scoped=True)
    assert len(optimizer.state) == len(list(model.parameters()))
    for state in optimizer.state.values():
        assert {"step", "exp_avg", "exp_avg_sq"} <= set(state)
        for value in state.values():
            assert_alive(value)
    train(model, optimizer, batches[1:], scoped=False)  # and it keeps working outside scopes

    assert_same_state(model, optimizer, reference, reference_optimizer)


@optimizers
def test_live_refs_do_not_grow_across_iterations(make_optimizer: OptimizerFactory) -> None:
    """After the first step, ``ts.stats().live`` is the same after every iteration."""
    batches = make_batches(6)
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    ts.reset_stats()
    lives = []
    for x, y in batches:
        with ts.scope() as s:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            assert len(s) > 0
        lives.append(ts.stats().live)
    assert lives[1:] == [lives[1]] * (len(lives) - 1), lives


@pytest.mark.parametrize("built_in_scope", [False, True], ids=["built-outside", "built-inside"])
def test_batchnorm_buffers_update_as_without_scopes(built_in_scope: bool) -> None:
    """Running statistics and ``num_batches_tracked`` update in place exactly as unscoped."""
    make_optimizer = OPTIMIZERS["sgd-momentum"]
    batches = make_batches(4)
    reference, reference_optimizer, reference_losses = reference_run(
        make_optimizer, batches, batchnorm=True
    )

    with step_scope(built_in_scope):
        model = make_model(batchnorm=True)
        optimizer = make_optimizer(model.parameters())
    losses = train(model, optimizer, batches, scoped=True)

    assert losses == reference_losses
    assert_same_state(model, optimizer, reference, reference_optimizer)
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d)
    assert bn.num_batches_tracked.item() == len(batches)
    assert not torch.equal(bn.running_mean, torch.zeros(HIDDEN))

    # evaluation inside a scope uses the running statistics, also as without scopes
    model.eval()
    reference.eval()
    x = batches[0][0]
    with torch.no_grad():
        expected = reference(x)
        with ts.scope():
            out = model(x).move_to_outer()
    assert torch.equal(out, expected)


def test_per_step_results_moved_to_an_epoch_scope() -> None:
    """Losses moved out of each step's scope live until the epoch's scope closes."""
    make_optimizer = OPTIMIZERS["adam"]
    batches = make_batches(4)
    _, _, reference_losses = reference_run(make_optimizer, batches)

    model = make_model()
    optimizer = make_optimizer(model.parameters())
    kept: list[torch.Tensor] = []
    with ts.scope() as epoch:
        for x, y in batches:
            with ts.scope():
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                kept.append(loss.detach().move_to_outer())
            assert loss.is_disposed
        assert all(t.scope is epoch for t in kept)
        assert [t.item() for t in kept] == reference_losses
        mean = torch.stack(kept).mean().item()
    assert all(t.is_disposed for t in kept)
    assert mean == torch.tensor(reference_losses).mean().item()
