"""Activation offload on tiny transformers models (random weights from a config): GPT-2 and
Llama train bit-identically with every block's saved tensors on the disk tier."""

from __future__ import annotations

import pytest
import torch

import tensorscope as ts
from tensorscope.fit.offload import offload_blocks

from ._support import assert_same, blocks_of, grads, hf_input, hf_model, released

pytestmark = [
    pytest.mark.engine_independent,  # ts.fit outside scopes (checked)
    pytest.mark.strict,  # moves data through the device backend (tests/conftest.py)
]

pytest.importorskip("transformers")


def _loss(model: torch.nn.Module, ids: torch.Tensor, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)  # GPT-2's dropout: the same masks in every run
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


@pytest.mark.engine_dependent  # scopes or ts.manage
@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("scoped", [False, True])
def test_training_steps_bit_identical(name: str, scoped: bool) -> None:
    model, ids = hf_model(name), hf_input()
    expected = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss = _loss(model, ids, step)
        loss.backward()
        expected.append((loss.item(), grads(model)))
    handle = offload_blocks(blocks_of(model), min_bytes=0)
    for step in range(2):  # the second step reuses the first one's file regions
        model.zero_grad(set_to_none=True)
        if scoped:
            with ts.scope():
                loss = _loss(model, ids, step)
                loss.backward()
                value = loss.item()
        else:
            loss = _loss(model, ids, step)
            loss.backward()
            value = loss.item()
        del loss
        assert value == expected[step][0]
        assert_same(grads(model), expected[step][1])
        assert released(handle.offloader)
    stats = handle.stats()
    assert sorted(stats.groups) == [0, 1, 2]
    for group in stats.groups.values():
        assert group.offloaded_bytes > 0
        assert group.kept.get("PARAMETER", 0) > 0
    if name == "llama":  # position_embeddings=(cos, sin): the caller's, kept for every block
        assert all(group.kept.get("CONTEXT", 0) > 0 for group in stats.groups.values())
    handle.remove()


def test_gpt2_with_hf_gradient_checkpointing_offloads_block_inputs() -> None:
    """transformers checkpoints a layer's ``forward`` (its module hooks stay outside): our hooks
    are the outer ones, so what the checkpoint saves itself, the block's input, is offloaded,
    and the recomputation reads it back."""
    model, ids = hf_model("gpt2"), hf_input()
    model.zero_grad(set_to_none=True)
    _loss(model, ids).backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with offload_blocks(blocks_of(model), min_bytes=0) as handle:
        _loss(model, ids).backward()
        groups = handle.stats().groups
        assert released(handle.offloader)
    assert_same(grads(model), expected)
    hidden_bytes = ids.numel() * 64 * 4
    for group in groups.values():
        assert group.offloaded_storages == 1 and group.offloaded_bytes == hidden_bytes


def test_default_threshold_keeps_tiny_tensors() -> None:
    model, ids = hf_model("gpt2"), hf_input()
    with offload_blocks(blocks_of(model)) as handle:  # 1 MiB: nothing of this tiny model
        _loss(model, ids).backward()
        stats = handle.stats()
    assert stats.bytes_written == 0
    assert all(group.kept.get("SMALL", 0) > 0 for group in stats.groups.values())


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bytes_leave_memory(name: str) -> None:
    """The offloader's own accounting: with one unwritten entry at a time, the forward holds at
    most the largest storage, where ``measure_only`` (same decisions, no I/O) holds them all."""
    model, ids = hf_model(name), hf_input()
    peaks = {}
    for measure_only in (True, False):
        with offload_blocks(
            blocks_of(model), min_bytes=0, max_in_flight_bytes=1, measure_only=measure_only
        ) as handle:
            loss = _loss(model, ids)
            stats = handle.stats()
            loss.backward()
            del loss
            assert released(handle.offloader)
            total = sum(group.offloaded_bytes for group in stats.groups.values())
            peaks[measure_only] = (stats.peak_ram_bytes, total, handle.stats().peak_ram_bytes)
    held_plain, total, _ = peaks[True]
    held_forward, _, held_step = peaks[False]
    assert held_plain == total > 0
    largest = 2 * 16 * 4 * 64 * 4  # the MLP's (GPT-2) or gate/up (Llama) activations at most
    assert held_forward <= largest < total / 4
    assert held_step < total  # the backward reads back two groups at a time, not three


def test_offloading_the_same_blocks_twice_steps_aside() -> None:
    model, ids = hf_model("gpt2"), hf_input()
    with (
        offload_blocks(blocks_of(model), min_bytes=0) as first,
        offload_blocks(blocks_of(model), min_bytes=0) as second,
    ):
        _loss(model, ids).backward()
        assert len(first.stats().groups) == 3
        assert second.stats().groups == {}  # the first one's hooks are active around it
