"""transformers models train under tensorscope exactly as without it (item 1 of the matrix).

AdamW + ``clip_grad_norm_`` + a linear warmup schedule + gradient accumulation over two
micro-batches, 3 optimizer steps, dropout on (seeded): losses and final parameters and buffers
must be bit-identical to the plain run, with each micro-batch and each optimizer step in its own
scope ("scope"), and with the model managed under a budget below its size ("flow", "genoa").
"""

from __future__ import annotations

import functools

import pytest
import torch

from . import _models as M


@functools.cache
def _plain(
    name: str, checkpointing: bool, steps: int, clip: bool = True
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, losses = M.hf_train(
        name, M.Run("plain"), steps=steps, checkpointing=checkpointing, clip=clip
    )
    return losses, M.state_of(model)


@pytest.mark.parametrize("mode", M.MODES)
@pytest.mark.parametrize("name", M.HF_MODELS)
def test_training_matches_plain(name: str, mode: str) -> None:
    expected_losses, expected_state = _plain(name, False, 3)
    model, losses = M.hf_train(name, M.Run(mode), steps=3)
    assert losses == expected_losses
    M.assert_same_state(model, expected_state)


@pytest.mark.parametrize("mode", M.MODES)
@pytest.mark.parametrize("name", M.HF_MODELS)
def test_gradient_checkpointing_one_step(name: str, mode: str) -> None:
    expected_losses, expected_state = _plain(name, True, 1)
    model, losses = M.hf_train(name, M.Run(mode), steps=1, checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert losses == expected_losses
    M.assert_same_state(model, expected_state)


@pytest.mark.parametrize("mode", M.RESIDENCY_MODES)
@pytest.mark.parametrize("name", M.HF_MODELS)
def test_managed_training_without_clipping_matches_plain(name: str, mode: str) -> None:
    """The same loop without ``clip_grad_norm_`` (a multi-tensor op over all parameters).

    Not a weaker duplicate: it tells a failure of the foreach norm under a budget (the test
    above) from a failure of managed training itself.
    """
    expected_losses, expected_state = _plain(name, False, 3, clip=False)
    model, losses = M.hf_train(name, M.Run(mode), steps=3, clip=False)
    assert losses == expected_losses
    M.assert_same_state(model, expected_state)


def test_plain_reference_is_deterministic() -> None:
    """The comparison is meaningful: two plain runs agree bit for bit, and training moved."""
    losses, state = _plain("llama", False, 3)
    model, again = M.hf_train("llama", M.Run("plain"), steps=3)
    assert again == losses
    M.assert_same_state(model, state)
    fresh = M.state_of(M.build("llama"))
    assert any(not torch.equal(fresh[k], state[k]) for k in state)
