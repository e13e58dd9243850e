"""``copy.deepcopy``, ``torch.save``/``torch.load`` and ``pickle`` inside a scope (item 9).

Client code that snapshots state in the middle of a scoped training step: an EMA/best-model copy
(``deepcopy(model)``), ``deepcopy(model.state_dict())``, ``deepcopy(optimizer.state_dict())``, a
checkpoint written and read back with ``torch.save``/``torch.load``, and ``pickle``. The copies
equal the originals, the originals stay alive, and what the copies are loaded into (a module, an
optimizer) keeps working after the scope, exactly as in the same code run without scopes.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import tensorscope as ts

from . import _models as M


def _trained(mode: str = "plain") -> tuple[torch.nn.Module, torch.optim.Optimizer, M.Run]:
    model = M.mlp(batchnorm=True)
    run = M.Run(mode)
    run.manage(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    M.mlp_train(model, M.mlp_batches(2), run.step, optimizer=optimizer)
    return model, optimizer, run


def _eval_out(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    try:
        with torch.no_grad():
            return M.plain_copy(model(M.mlp_batches(1, seed=9)[0][0]))
    finally:
        model.train()


def test_deepcopy_of_a_model_with_buffers_in_a_scope_survives_the_scope() -> None:
    model, _, _ = _trained()
    expected_state = M.state_of(model)
    with ts.scope():
        twin = copy.deepcopy(model)
        assert torch.equal(_eval_out(twin), _eval_out(model))
    M.assert_same_state(twin, expected_state)
    M.assert_same_state(model, expected_state)
    assert torch.equal(_eval_out(twin), _eval_out(model))
    # the copy trains independently, like the original would
    M.mlp_train(twin, M.mlp_batches(1, seed=4), M.Run("scope").step)
    M.assert_same_state(model, expected_state)


def test_deepcopy_of_a_state_dict_in_a_scope_loads_into_a_fresh_model() -> None:
    model, _, _ = _trained()
    expected_state = M.state_of(model)
    fresh = M.mlp(batchnorm=True, seed=1)
    with ts.scope():
        snapshot = copy.deepcopy(model.state_dict())
        for key, value in snapshot.items():
            assert torch.equal(value, expected_state[key]), key
        fresh.load_state_dict(snapshot)
    M.assert_same_state(fresh, expected_state)
    M.assert_same_state(model, expected_state)


def _continue(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[float]:
    return M.mlp_train(model, M.mlp_batches(2, seed=5), M.Run("scope").step, optimizer=optimizer)


def test_deepcopy_of_optimizer_state_in_a_scope_resumes_training_exactly() -> None:
    model, optimizer, _ = _trained()
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.Adam(twin.parameters(), lr=1e-2)
    with ts.scope():
        state = copy.deepcopy(optimizer.state_dict())
        twin_optimizer.load_state_dict(state)
    for group in twin_optimizer.state.values():
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                M.assert_alive(value, f"optimizer state {key}")
    expected = M.mlp_train(
        model, M.mlp_batches(2, seed=5), M.Run("plain").step, optimizer=optimizer
    )
    assert _continue(twin, twin_optimizer) == expected
    M.assert_same_state(twin, M.state_of(model))


def _checkpoint(mode: str) -> tuple[torch.nn.Module, io.BytesIO]:
    """Train 2 steps (in ``mode``), then save model and optimizer state inside a scope."""
    model, optimizer, run = _trained(mode)
    with run.step():
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    M.assert_module_alive(model)
    run.check_budget()
    buffer.seek(0)
    return model, buffer


@pytest.mark.parametrize("mode", M.MODES)
def test_torch_save_and_load_of_model_state_in_a_scope(mode: str) -> None:
    expected_state = M.state_of(_trained("plain")[0])
    _, buffer = _checkpoint(mode)
    fresh = M.mlp(batchnorm=True, seed=1)
    with ts.scope():
        checkpoint = torch.load(buffer, weights_only=True)
        for key, value in checkpoint["model"].items():
            assert torch.equal(value, expected_state[key]), key
        fresh.load_state_dict(checkpoint["model"])
    M.assert_same_state(fresh, expected_state)


@pytest.mark.parametrize("mode", M.MODES)
def test_torch_save_and_load_of_optimizer_state_in_a_scope(mode: str) -> None:
    """Resuming: the optimizer state loaded inside a scope is optimizer state (never owned)."""
    reference, reference_optimizer, _ = _trained("plain")
    _, buffer = _checkpoint(mode)
    fresh = M.mlp(batchnorm=True, seed=1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with ts.scope():
        checkpoint = torch.load(buffer, weights_only=True)
        fresh.load_state_dict(checkpoint["model"])
        fresh_optimizer.load_state_dict(checkpoint["optimizer"])
    expected = M.mlp_train(
        reference, M.mlp_batches(2, seed=5), M.Run("plain").step, optimizer=reference_optimizer
    )
    assert _continue(fresh, fresh_optimizer) == expected
    M.assert_same_state(fresh, M.state_of(reference))


def test_torch_save_of_scope_tensors_loads_as_plain_tensors() -> None:
    buffer = io.BytesIO()
    with ts.scope():
        made = torch.arange(6.0).reshape(2, 3) * 2
        view = made[:, 1:]
        torch.save({"made": made, "view": view}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded["made"]) is torch.Tensor and type(loaded["view"]) is torch.Tensor
    assert torch.equal(loaded["made"], torch.arange(6.0).reshape(2, 3) * 2)
    assert torch.equal(loaded["view"], loaded["made"][:, 1:])


def test_pickle_round_trip_in_a_scope() -> None:
    model, _, _ = _trained()
    expected_state = M.state_of(model)
    with ts.scope():
        made = torch.linspace(0, 1, 5) * 3
        payload = pickle.dumps({"made": made, "state": model.state_dict(), "model": model})
        restored = pickle.loads(payload)
        assert torch.equal(restored["made"], made)
        for key, value in restored["state"].items():
            assert torch.equal(value, expected_state[key]), key
    # the unpickled module is a module of its own: alive and equal after the scope
    M.assert_same_state(restored["model"], expected_state)
    M.assert_same_state(model, expected_state)
