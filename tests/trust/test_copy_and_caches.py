"""#6, #8, #9, #12: copies made inside scopes, and tensors that torch or a module keeps as its
own long-lived state (autocast's weight-cast cache, a DataLoader's reorder buffer, a GradScaler's
lazily made scale, buffers replaced by ``module.to()``) must not be disposed by a scope."""

from __future__ import annotations

import contextlib
import copy
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tensorscope as ts

from . import _models as M

# ----------------------------------------------------------------------------- #6 deepcopy


def test_deepcopy_of_a_plain_tensor_inside_a_scope_copies_it() -> None:
    """#6: copy.deepcopy of a plain tensor inside a scope gives an equal, distinct tensor."""
    t = torch.arange(6.0).reshape(2, 3)
    with ts.scope():
        copied = copy.deepcopy(t)
        assert copied is not t and torch.equal(copied, t)
        assert copied.data_ptr() != t.data_ptr()


def test_deepcopy_of_a_model_with_buffers_inside_a_scope_gives_a_working_model() -> None:
    """#6: copy.deepcopy(model) with buffers in a scope gives a model intact after the scope."""
    model = M.mlp(batchnorm=True)
    model.train()
    model(torch.randn(8, 16))  # non-trivial running statistics
    model.eval()
    expected = M.state_of(model)
    x = torch.randn(4, 16)
    expected_out = model(x).detach()
    with ts.scope():
        clone = copy.deepcopy(model)
    M.assert_same_state(clone, expected)
    assert torch.equal(clone(x), expected_out)


def test_deepcopy_of_a_state_dict_inside_a_scope_loads_into_a_fresh_model() -> None:
    """#6: copy.deepcopy(state_dict) in a scope works and loads into a fresh model.

    Whether such copies outlive the scope is not specified by the issue; only their use inside
    it is checked.
    """
    model = M.mlp(batchnorm=True)
    state = model.state_dict()
    with ts.scope():
        copied = copy.deepcopy(state)
        fresh = M.mlp(batchnorm=True, seed=5)
        fresh.load_state_dict(copied)
        for key, value in state.items():
            assert torch.equal(fresh.state_dict()[key], value), key


def test_deepcopy_of_optimizer_state_inside_a_scope_resumes_training_exactly() -> None:
    """#6: copy.deepcopy(optimizer.state_dict()) in a scope resumes training exactly."""
    batches = M.mlp_batches(4)
    model = M.mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    M.train_mlp(model, batches[:2], scoped=False, optimizer=optimizer)
    snapshot_model = copy.deepcopy(model)
    with ts.scope():
        saved = copy.deepcopy(optimizer.state_dict())
        resumed = torch.optim.Adam(snapshot_model.parameters(), lr=1e-2)
        resumed.load_state_dict(saved)
    M.train_mlp(model, batches[2:], scoped=False, optimizer=optimizer)
    M.train_mlp(snapshot_model, batches[2:], scoped=False, optimizer=resumed)
    M.assert_same_state(snapshot_model, M.state_of(model))


# ----------------------------------------------------------------------------- #8 autocast


def _autocast_around_scoped_steps(model: nn.Module, steps: int, *, scoped: bool) -> list[float]:
    """SGD steps on an MLP, one bf16 autocast opened once around all of them."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x, y in M.mlp_batches(steps):
            with ts.scope() if scoped else contextlib.nullcontext():
                loss = nn.functional.mse_loss(model(x).float(), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
    return losses


def test_autocast_opened_around_a_loop_of_scopes_trains_like_plain() -> None:
    """#8: an autocast opened around a loop of scoped steps trains exactly like plain."""
    reference = M.mlp(depth=2)
    expected = _autocast_around_scoped_steps(reference, 3, scoped=False)
    model = M.mlp(depth=2)
    assert _autocast_around_scoped_steps(model, 3, scoped=True) == expected
    M.assert_same_state(model, M.state_of(reference))


def _lm_steps_under_one_autocast(model: nn.Module, *, scoped: bool) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for step in range(2):
            ids = M.token_ids(step)
            with ts.scope() if scoped else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
    return losses


def test_autocast_around_scoped_steps_of_a_transformers_model_matches_plain() -> None:
    """#8: the same with a tiny Llama (AdamW, 2 steps)."""
    expected = _lm_steps_under_one_autocast(M.tiny_lm("llama"), scoped=False)
    assert _lm_steps_under_one_autocast(M.tiny_lm("llama"), scoped=True) == expected


# ----------------------------------------------------------------------------- #9 DataLoader

BATCH = 4
BATCHES = 4


class SlowEvenBatches(Dataset[torch.Tensor]):
    """Deterministic samples; the first item of every even batch is slow, so the next (odd)
    batch, made by the other worker, arrives first and waits in the loader's reorder buffer."""

    def __len__(self) -> int:
        return BATCH * BATCHES

    def __getitem__(self, index: int) -> torch.Tensor:
        if index % (2 * BATCH) == 0:
            time.sleep(0.2)
        return torch.full((3,), float(index))


def test_a_batch_parked_in_the_dataloader_reorder_buffer_survives_the_scope_that_received_it() -> (
    None
):
    """#9: a batch parked in a DataLoader's reorder buffer survives the scope that received it."""
    loader = DataLoader(SlowEvenBatches(), batch_size=BATCH, num_workers=2, prefetch_factor=2)
    expected = [
        torch.arange(i * BATCH, (i + 1) * BATCH, dtype=torch.float32) for i in range(BATCHES)
    ]
    got = []
    iterator = iter(loader)
    try:
        for _ in range(BATCHES):
            with ts.scope():
                batch = next(iterator)
                got.append(M.plain_copy(batch[:, 0]))
    finally:
        iterator._shutdown_workers()  # type: ignore[attr-defined]
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"batch {i}"


# ----------------------------------------------------------------------------- #12 state


def _scaler_steps(*, scoped: bool) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    model = M.mlp(depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    losses = []
    for x, y in M.mlp_batches(3):
        with ts.scope() if scoped else contextlib.nullcontext():
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
    return losses, scaler.get_scale(), M.state_of(model)


def test_gradscaler_first_used_inside_a_scope_keeps_its_scale_and_trains_like_plain() -> None:
    """#12: a GradScaler first used in a scope keeps its scale and trains like plain."""
    expected_losses, expected_scale, expected_state = _scaler_steps(scoped=False)
    losses, scale, state = _scaler_steps(scoped=True)
    assert losses == expected_losses
    assert scale == expected_scale
    assert state.keys() == expected_state.keys()
    for key, value in state.items():
        assert torch.equal(value, expected_state[key]), key


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_module_to_dtype_inside_a_scope_keeps_batchnorm_buffers(dtype: torch.dtype) -> None:
    """#12: model.to(dtype) inside a scope keeps BatchNorm's (replaced) buffers."""
    reference = M.mlp(batchnorm=True)
    reference(torch.randn(8, 16))
    model = copy.deepcopy(reference)
    reference.to(dtype)
    with ts.scope():
        model.to(dtype)
    M.assert_same_state(model, M.state_of(reference))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_rotary_model_converted_inside_a_scope_keeps_inv_freq(name: str) -> None:
    """#12: a rotary LM converted with .to(bfloat16) inside a scope keeps inv_freq."""
    reference = M.tiny_lm(name).to(torch.bfloat16)
    model = M.tiny_lm(name)
    with ts.scope():
        model.to(torch.bfloat16)
    M.assert_same_state(model, M.state_of(reference))
    ids = M.token_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
