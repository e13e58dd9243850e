"""``module.to(dtype)``, ``.half()``, ``.float()``, ``.double()`` inside a scope, and BatchNorm
running statistics (item 11).

``Module._apply`` replaces parameters' data and buffers with converted tensors made inside the
scope; they are the module's state, so the scope must not own them: after the scope the model's
buffers (BatchNorm's running stats and ``num_batches_tracked``, the rotary ``inv_freq``) are
alive and equal to the same conversion done without a scope.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tensorscope as ts

from . import _models as M

CONVERSIONS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "to_double": lambda m: m.to(torch.float64),
    "double": lambda m: m.double(),
    "half_then_float": lambda m: m.half().float(),
    "to_bfloat16_then_float": lambda m: m.to(torch.bfloat16).to(dtype=torch.float32),
    "to_cpu": lambda m: m.to("cpu"),
    "float_noop": lambda m: m.float(),
}


def _bn_model_after(conversion: str, scoped: bool) -> nn.Module:
    model = M.mlp(batchnorm=True)
    M.mlp_train(model, M.mlp_batches(1), M.Run("plain").step)  # running stats moved once
    with M.Run("scope" if scoped else "plain").step():
        model = CONVERSIONS[conversion](model)
        dtype = next(model.parameters()).dtype
        x = M.mlp_batches(1, seed=7)[0][0].to(dtype)
        model(x)  # a train-mode forward inside the scope updates the running stats
    return model


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_conversion_of_a_batchnorm_model_in_a_scope(conversion: str) -> None:
    expected = M.state_of(_bn_model_after(conversion, scoped=False))
    model = _bn_model_after(conversion, scoped=True)
    M.assert_same_state(model, expected)
    # and it keeps training after the scope
    dtype = next(model.parameters()).dtype
    batches = [(x.to(dtype), y.to(dtype)) for x, y in M.mlp_batches(2, seed=3)]
    M.mlp_train(model, batches, M.Run("scope").step)
    M.assert_module_alive(model)


@pytest.mark.parametrize("name", M.ROTARY)
def test_rotary_model_converted_in_a_scope_keeps_inv_freq(name: str) -> None:
    ids = M.prompt(name)["input_ids"]
    plain = M.build(name).eval().to(torch.bfloat16)
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
    model = M.build(name).eval()
    with ts.scope():
        model.to(torch.bfloat16)
    for key, value in model.named_buffers():
        M.assert_alive(value, key)
        assert torch.equal(value, dict(plain.named_buffers())[key]), key
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)


@functools.cache
def _plain_bn_training() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = M.mlp(batchnorm=True)
    losses = M.mlp_train(model, M.mlp_batches(3), M.Run("plain").step)
    return losses, M.state_of(model)


@pytest.mark.parametrize("mode", M.MODES)
def test_batchnorm_running_stats_in_scoped_training(mode: str) -> None:
    expected_losses, expected_state = _plain_bn_training()
    model = M.mlp(batchnorm=True)
    run = M.Run(mode)
    run.manage(model)
    losses = M.mlp_train(model, M.mlp_batches(3), run.step)
    assert losses == expected_losses
    M.assert_same_state(model, expected_state)  # running_mean/var, num_batches_tracked
    assert int(model[1].num_batches_tracked) == 3
    run.check_budget()
