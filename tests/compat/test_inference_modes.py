"""``torch.inference_mode()`` and ``torch.no_grad()`` forwards under tensorscope (item 2).

A forward under either mode, with a scope inside the mode or the mode inside a scope, gives the
plain logits; the model's buffers (the rotary ``inv_freq`` of Llama and Qwen2, BERT's
``position_ids``/``token_type_ids``) survive the scope, and a second forward equals the first.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import pytest
import torch

import tensorscope as ts

from . import _models as M

GRAD_MODES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
}


@functools.cache
def _plain_logits(name: str, grad_mode: str) -> torch.Tensor:
    model = M.build(name).eval()
    with GRAD_MODES[grad_mode]():
        return model(**_inputs(name)).logits.clone()


def _inputs(name: str) -> dict[str, torch.Tensor]:
    inputs = M.batch(name, 0)
    if name == "t5":  # teacher-forced decoder input instead of a loss
        inputs["decoder_input_ids"] = inputs.pop("labels")
    else:
        inputs.pop("labels")
    return inputs


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


@pytest.mark.parametrize("nesting", ["scope_in_mode", "mode_in_scope"])
@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("name", M.HF_MODELS)
def test_forward_in_a_scope_matches_plain(name: str, grad_mode: str, nesting: str) -> None:
    expected = _plain_logits(name, grad_mode)
    model = M.build(name).eval()
    buffers = _buffers(model)
    enter_mode = GRAD_MODES[grad_mode]
    for _ in range(2):  # the second forward must equal the first
        if nesting == "scope_in_mode":
            with enter_mode(), ts.scope():
                assert torch.equal(model(**_inputs(name)).logits, expected)
        else:
            with ts.scope(), enter_mode():
                assert torch.equal(model(**_inputs(name)).logits, expected)
        for key, value in model.named_buffers():
            M.assert_alive(value, key)
            assert torch.equal(value, buffers[key]), key
    M.assert_module_alive(model)
    with enter_mode():  # and the model still works outside any scope
        assert torch.equal(model(**_inputs(name)).logits, expected)


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("mode", M.RESIDENCY_MODES)
@pytest.mark.parametrize("name", M.HF_MODELS)
def test_managed_forward_matches_plain(name: str, mode: str, grad_mode: str) -> None:
    expected = _plain_logits(name, grad_mode)
    model = M.build(name).eval()
    buffers = _buffers(model)
    run = M.Run(mode)
    run.manage(model)
    for _ in range(2):
        with GRAD_MODES[grad_mode](), ts.scope():
            assert torch.equal(model(**_inputs(name)).logits, expected)
    for key, value in model.named_buffers():
        M.assert_alive(value, key)
        assert torch.equal(value, buffers[key]), key
    M.assert_module_alive(model)
    run.check_budget()


NOOP_CONVERSIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "to_dtype": lambda t: t.to(torch.float32),
    "to_device": lambda t: t.to("cpu"),
    "float": lambda t: t.float(),
    "cpu": lambda t: t.cpu(),
    "type_as": lambda t: t.type_as(t),
    "contiguous": lambda t: t.contiguous(),
    "resolve_conj": lambda t: t.resolve_conj(),
    "resolve_neg": lambda t: t.resolve_neg(),
    "detach": lambda t: t.detach(),
    "requires_grad_false": lambda t: t.requires_grad_(False),
}


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("conversion", list(NOOP_CONVERSIONS))
def test_noop_conversion_in_a_scope_keeps_its_input(conversion: str, grad_mode: str) -> None:
    """What a rotary embedding does with its buffer (``inv_freq.float()``), reduced to one op.

    A conversion that returns its input (or an alias of it) must not hand the input to the scope.
    """
    convert = NOOP_CONVERSIONS[conversion]
    outside = torch.arange(4.0)
    with ts.scope(), GRAD_MODES[grad_mode]():
        result = convert(outside) * 2
        assert torch.equal(result, torch.arange(0.0, 8.0, 2.0))
    M.assert_alive(outside, "the converted tensor")
    assert torch.equal(outside, torch.arange(4.0))


def test_tensor_made_under_inference_mode_then_used_under_no_grad_in_a_scope() -> None:
    with torch.inference_mode():
        made = torch.arange(6.0).reshape(2, 3)
    with ts.scope(), torch.no_grad():
        assert torch.equal(made.to(torch.float32).sum(0), torch.tensor([3.0, 5.0, 7.0]))
    M.assert_alive(made, "the inference tensor")
    assert made.sum().item() == 15.0


@functools.cache
def _plain_logits_with_grad(name: str) -> torch.Tensor:
    model = M.build(name).eval()
    return model(**_inputs(name)).logits.detach().clone()


@pytest.mark.parametrize("name", M.HF_MODELS)
def test_a_forward_with_grad_on_in_a_scope_closes_cleanly(name: str) -> None:
    """An evaluation loop that forgot ``no_grad``: the graph (with GPT-2's ``split`` views of
    one base) is disposed with the scope, which closes without error; the logits equal plain
    and the next forward too."""
    model = M.build(name).eval()
    for _ in range(2):
        with ts.scope():
            logits = M.plain_copy(model(**_inputs(name)).logits)
        assert torch.equal(logits, _plain_logits_with_grad(name))
    M.assert_module_alive(model)
