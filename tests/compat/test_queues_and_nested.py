"""Tensors handed to a multiprocessing queue, and nested tensors, inside scopes.

``multiprocessing.Queue.put(t)`` pickles ``t`` later, on the queue's feeder thread: a scope that
closed meanwhile disposed it, the item was dropped and the consumer's ``get()`` blocked forever.
A tensor put on a queue now leaves its scope (the queue delivers it, as torch shares it), and a
disposed one raises at ``put()``.

A strided nested tensor is a plain tensor to a scope (owned, disposed at exit); a jagged one is
a Python tensor subclass whose values, offsets and cached lengths are its own (never owned), so
it lives on after the scope as in plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import tensorscope as ts


def _consume(inbox: object, outbox: object) -> None:
    tensor = inbox.get(timeout=60)  # type: ignore[attr-defined]
    outbox.put(float(tensor.sum()))  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_tensor_put_on_a_queue_inside_a_scope_is_delivered() -> None:
    context = mp.get_context("spawn")
    inbox, outbox = context.Queue(), context.Queue()
    consumer = context.Process(target=_consume, args=(inbox, outbox))
    consumer.start()
    try:
        with ts.scope() as s:
            sent = torch.arange(1000, dtype=torch.float32) * 2
            inbox.put(sent)
            assert sent not in s  # the queue's now
        assert not sent.is_disposed
        assert outbox.get(timeout=60) == float(sent.sum())
    finally:
        consumer.join(timeout=30)
        if consumer.is_alive():
            consumer.kill()


def test_putting_a_disposed_tensor_on_a_queue_raises_at_once() -> None:
    queue = mp.get_context("spawn").Queue()
    with ts.scope():
        gone = torch.ones(3)
    with pytest.raises(ts.DisposedTensorError, match=r"shape \(3,\)"):
        queue.put({"batch": [gone]})
    queue.close()


def _parts() -> list[torch.Tensor]:
    return [torch.arange(4.0).reshape(2, 2), torch.arange(6.0).reshape(3, 2)]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_a_strided_nested_tensor_is_owned_and_disposed_and_can_be_moved_out() -> None:
    expected = torch.nested.nested_tensor(_parts()).to_padded_tensor(0.0)
    with ts.scope() as s:
        nested = torch.nested.nested_tensor(_parts())
        kept = s.move_to_outer(torch.nested.nested_tensor(_parts()) * 2)
        assert torch.equal(nested.to_padded_tensor(0.0), expected)
        assert nested in s
    assert nested.is_disposed
    with pytest.raises(ts.DisposedTensorError):
        nested.to_padded_tensor(0.0)
    assert torch.equal(kept.to_padded_tensor(0.0), expected * 2)


def test_a_jagged_nested_tensor_lives_on_after_its_scope_with_its_cached_lengths() -> None:
    expected = torch.nested.nested_tensor(_parts(), layout=torch.jagged).to_padded_tensor(0.0)
    assert expected.shape == (2, 3, 2)
    with ts.scope() as s:
        made_inside = torch.nested.nested_tensor(_parts(), layout=torch.jagged)
        doubled = made_inside * 2
        assert len(s) == 0  # its components are the subclass's own
    outside = torch.nested.nested_tensor(_parts(), layout=torch.jagged)
    with ts.scope():
        assert torch.equal(outside.to_padded_tensor(0.0), expected)  # caches lengths inside
    assert torch.equal(made_inside.to_padded_tensor(0.0), expected)
    assert torch.equal(doubled.to_padded_tensor(0.0), expected * 2)
    assert torch.equal(outside.to_padded_tensor(0.0), expected)
