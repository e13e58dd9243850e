"""``torch.autocast("cpu", dtype=torch.bfloat16)`` under tensorscope (item 4).

Two placements: opened inside each scope ("inside"), and opened once around the loop of scoped
steps ("around"). In the second, autocast's weight-cast cache lives across steps: the bf16 copies
of the weights made in the first step are reused by the next ones (exactly as in plain PyTorch,
which clears the cache only when the outermost autocast exits), so a scope must not own them.
Compared bit for bit with the same autocast loop run without tensorscope.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from . import _models as M

PLACEMENTS = ("inside", "around")


@functools.cache
def _plain_hf(name: str, placement: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, losses = M.hf_train(name, M.Run("plain"), steps=2, autocast=placement)
    return losses, M.state_of(model)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("name", M.HF_MODELS)
def test_hf_training_under_autocast_matches_plain(name: str, placement: str) -> None:
    expected_losses, expected_state = _plain_hf(name, placement)
    model, losses = M.hf_train(name, M.Run("scope"), steps=2, autocast=placement)
    assert losses == expected_losses
    M.assert_same_state(model, expected_state)


def _mlp_autocast_train(mode: str, placement: str) -> tuple[torch.nn.Module, list[float]]:
    model = M.mlp(batchnorm=True)
    run = M.Run(mode)
    run.manage(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    around = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if placement == "around"
        else contextlib.nullcontext()
    )
    with around:
        for x, y in M.mlp_batches(3):
            with run.step():
                inside = (
                    torch.autocast("cpu", dtype=torch.bfloat16)
                    if placement == "inside"
                    else contextlib.nullcontext()
                )
                with inside:
                    out = model(x)
                    assert out.dtype == torch.bfloat16
                    loss = torch.nn.functional.mse_loss(out.float(), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
    run.check_budget()
    return model, losses


@functools.cache
def _plain_mlp(placement: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, losses = _mlp_autocast_train("plain", placement)
    return losses, M.state_of(model)


@pytest.mark.parametrize("mode", M.MODES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_mlp_training_under_autocast_matches_plain(placement: str, mode: str) -> None:
    expected_losses, expected_state = _plain_mlp(placement)
    model, losses = _mlp_autocast_train(mode, placement)
    assert losses == expected_losses
    M.assert_same_state(model, expected_state)


@pytest.mark.parametrize("name", M.ROTARY)
def test_autocast_inference_around_scopes(name: str) -> None:
    """Inference under one autocast + no_grad around several scoped forwards."""
    model = M.build(name).eval()
    ids = M.prompt(name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(**ids).logits.clone()
        for _ in range(3):
            with M.Run("scope").step():
                assert torch.equal(model(**ids).logits, expected)
    M.assert_module_alive(model)
