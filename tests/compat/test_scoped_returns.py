"""What a ``@ts.scope()`` function returns keeps everything it needs (docs/api.md §1, §8).

A model's output is rarely a bare tensor: HF returns a ``ModelOutput`` (a dict) holding a
``DynamicCache`` (an object whose layers hold key and value tensors), users return dataclasses.
Every ref reachable through them moves to the caller's scope, so decoding can go on from a cache
a scoped function made, and a loss returned inside an output still backpropagates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import tensorscope as ts

from . import _models as M


def test_a_returned_model_output_keeps_its_cache_and_decoding_goes_on() -> None:
    model = M.build("gpt2").eval()
    ids = M.prompt("gpt2")["input_ids"]
    next_ids = torch.full((ids.shape[0], 1), 7)

    @ts.scope()
    def prefill(input_ids: torch.Tensor) -> object:
        return model(input_ids=input_ids, use_cache=True)

    with torch.no_grad():
        expected = model(
            input_ids=next_ids, past_key_values=model(input_ids=ids).past_key_values
        ).logits
        with ts.scope() as outer:
            out = prefill(ids)
            cache = out.past_key_values
            keys = [layer.keys for layer in cache.layers]
            assert all(k in outer for k in keys), "the cache's tensors moved to the caller"
            logits = model(input_ids=next_ids, past_key_values=cache).logits
            assert torch.equal(logits, expected)
        assert all(k.is_disposed for k in keys)  # and the caller's scope disposed them


@dataclass
class StepOutput:
    loss: torch.Tensor
    logits: torch.Tensor
    extras: dict[str, list[torch.Tensor]]


def test_a_returned_dataclass_keeps_its_tensors_and_their_graphs() -> None:
    model = M.mlp()
    x, y = M.mlp_batches(1)[0]

    @ts.scope()
    def step(inputs: torch.Tensor) -> StepOutput:
        logits = model(inputs)
        loss = torch.nn.functional.mse_loss(logits, y)
        return StepOutput(loss, logits, {"hidden": [logits.relu()]})

    torch.nn.functional.mse_loss(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with ts.scope() as outer:
        out = step(x)
        assert out.loss in outer and out.logits in outer and out.extras["hidden"][0] in outer
        out.loss.backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))
