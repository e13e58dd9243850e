"""#1: under ``torch.inference_mode()`` a no-op conversion returns its input object; a scope must
never take (and dispose at exit) a result that *is* one of the op's inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import tensorscope as ts

from . import _models as M

CONVERSIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "to_dtype": lambda t: t.to(torch.float32),
    "float": lambda t: t.float(),
    "cpu": lambda t: t.cpu(),
    "to_cpu": lambda t: t.to("cpu"),
    "type_as": lambda t: t.type_as(torch.zeros(1)),
    "resolve_conj": lambda t: t.resolve_conj(),
}


def _assert_intact(t: torch.Tensor, expected: torch.Tensor) -> None:
    assert not isinstance(t, ts.DisposedTensor), "the scope disposed a tensor it did not create"
    assert torch.equal(t, expected)


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_no_op_conversion_under_inference_mode_keeps_the_input_alive(conversion: str) -> None:
    """#1: a no-op conversion under inference_mode in a scope leaves its input alive."""
    buf = torch.arange(4.0)
    with ts.scope(), torch.inference_mode():
        doubled = CONVERSIONS[conversion](buf) * 2
        assert torch.equal(doubled, torch.arange(4.0) * 2)
    _assert_intact(buf, torch.arange(4.0))


def test_tensor_made_under_inference_mode_survives_a_no_op_to_under_no_grad() -> None:
    """#1: a tensor made under inference_mode survives a no-op .to() under no_grad in a scope."""
    with torch.inference_mode():
        made = torch.arange(4.0)
    with ts.scope(), torch.no_grad():
        made.to(torch.float32) * 2
    _assert_intact(made, torch.arange(4.0))


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_rotary_model_forwards_under_inference_mode_in_scopes_keep_inv_freq(name: str) -> None:
    """#1: rotary LM forwards under inference_mode in scopes keep inv_freq and plain logits."""
    model = M.tiny_lm(name)
    ids = M.token_ids()
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    with torch.inference_mode():
        expected = model(ids).logits.clone()
    for call in range(3):
        with ts.scope(), torch.inference_mode():
            logits = model(ids).logits
            assert torch.equal(logits, expected), f"call {call}"
    _assert_intact(model.model.rotary_emb.inv_freq, inv_freq)
