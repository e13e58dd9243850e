"""The LM head and its cross-entropy in row chunks (tensorscope/fit/chunkloss.py): the loss and
every gradient allclose to ``F.cross_entropy(F.linear(h, w, b).float(), y)``, without the
logits ever held whole."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional

import tensorscope as ts
from tensorscope.fit.chunkloss import chunk_rows_for, linear_cross_entropy


def _plain(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    y: torch.Tensor,
    softcap: float | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    z = functional.linear(h, w, b).float()  # HF's upcast
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return functional.cross_entropy(z, y, **kwargs)


def _inputs(
    n: int, hidden: int, vocab: int, dtype: torch.dtype, bias: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    return h, w, b


def _grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    scale = 1.7  # an incoming gradient other than 1
    return torch.autograd.grad(loss * scale, leaves)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 40),
    hidden=st.integers(1, 24),
    vocab=st.integers(2, 300),
    rows=st.integers(1, 41),
    ignored=st.integers(0, 41),
    reduction=st.sampled_from(["mean", "sum"]),
    smoothing=st.sampled_from([0.0, 0.1, 1.0]),
    bias=st.booleans(),
    softcap=st.sampled_from([None, 2.5]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_allclose_to_cross_entropy_of_the_linear(
    n: int,
    hidden: int,
    vocab: int,
    rows: int,
    ignored: int,
    reduction: str,
    smoothing: float,
    bias: bool,
    softcap: float | None,
    dtype: torch.dtype,
    seed: int,
) -> None:
    h, w, b = _inputs(n, hidden, vocab, dtype, bias, seed)
    y = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed + 1))
    y[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:ignored]] = -100
    leaves = [h, w] + ([b] if b is not None else [])
    options: dict[str, Any] = {"reduction": reduction, "label_smoothing": smoothing}
    mine = linear_cross_entropy(h, w, b, y, chunk_rows=min(rows, n + 1), softcap=softcap, **options)
    plain = _plain(h, w, b, y, softcap, **options)
    assert mine.dtype == plain.dtype == torch.float32
    torch.testing.assert_close(mine, plain, rtol=1e-5, atol=1e-5, equal_nan=True)
    got, expected = _grads(mine, leaves), _grads(plain, leaves)
    for leaf, a, e in zip(leaves, got, expected, strict=True):
        assert a.dtype == leaf.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        else:  # bfloat16: a few units in the last place of the largest value
            scale = float(e.float().abs().max()) if e.numel() else 0.0
            torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=2e-2 * scale)


def test_every_row_ignored_is_nan_and_no_gradient_as_in_torch() -> None:
    h, w, _ = _inputs(6, 4, 10, torch.float32, False, 0)
    y = torch.full((6,), -100)
    mine, plain = linear_cross_entropy(h, w, None, y), _plain(h, w, None, y)
    assert mine.isnan() and plain.isnan()
    for a, e in zip(_grads(mine, [h, w]), _grads(plain, [h, w]), strict=True):
        assert torch.equal(a, e) and not a.any()


@pytest.mark.parametrize("items", ["tensor", "int"])
def test_num_items_in_batch_divides_the_sum_as_hf(items: str) -> None:
    h, w, _ = _inputs(12, 8, 50, torch.float32, False, 1)
    y = torch.randint(0, 50, (12,))
    y[:3] = 7  # not ignored: any class index
    y[3:5] = -100
    count: torch.Tensor | int = torch.tensor(23) if items == "tensor" else 23
    mine = linear_cross_entropy(h, w, None, y, chunk_rows=5, num_items_in_batch=count)
    plain = _plain(h, w, None, y, reduction="sum") / count
    torch.testing.assert_close(mine, plain, rtol=1e-5, atol=0)
    for a, e in zip(_grads(mine, [h, w]), _grads(plain, [h, w]), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_another_ignore_index() -> None:
    h, w, _ = _inputs(10, 8, 30, torch.float32, False, 2)
    y = torch.randint(1, 30, (10,))
    y[::3] = 0
    mine = linear_cross_entropy(h, w, None, y, ignore_index=0, chunk_rows=3)
    plain = _plain(h, w, None, y, ignore_index=0)
    torch.testing.assert_close(mine, plain, rtol=1e-5, atol=0)


@pytest.mark.parametrize("needs", ["hidden", "weight", "bias", "none"])
def test_only_the_gradients_asked_for(needs: str) -> None:
    h, w, b = _inputs(9, 6, 40, torch.float32, True, 3)
    assert b is not None
    for name, leaf in (("hidden", h), ("weight", w), ("bias", b)):
        leaf.requires_grad_(name == needs)
    y = torch.randint(0, 40, (9,))
    mine = linear_cross_entropy(h, w, b, y, chunk_rows=4)
    plain = _plain(h, w, b, y)
    torch.testing.assert_close(mine, plain, rtol=1e-5, atol=0)
    assert mine.requires_grad == (needs != "none")
    if needs != "none":
        leaf = {"hidden": h, "weight": w, "bias": b}[needs]
        (a,), (e,) = _grads(mine, [leaf]), _grads(plain, [leaf])
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_no_gradients_under_no_grad() -> None:
    h, w, _ = _inputs(9, 6, 40, torch.float32, False, 4)
    y = torch.randint(0, 40, (9,))
    with torch.no_grad():
        mine = linear_cross_entropy(h, w, None, y, chunk_rows=2)
    assert not mine.requires_grad
    torch.testing.assert_close(mine, _plain(h, w, None, y).detach(), rtol=1e-5, atol=0)


def test_tied_weight_gradients_accumulate_through_autograd() -> None:
    torch.manual_seed(0)
    embed = torch.nn.Embedding(64, 8)
    ids = torch.randint(0, 64, (3, 7))

    def grads(loss_fn: Any) -> torch.Tensor:
        embed.zero_grad()
        h = torch.tanh(embed(ids)).reshape(-1, 8)
        loss_fn(h, embed.weight, None, ids.reshape(-1)).backward()
        assert embed.weight.grad is not None
        return embed.weight.grad.clone()

    mine = grads(lambda *a: linear_cross_entropy(*a, chunk_rows=4))
    torch.testing.assert_close(mine, grads(_plain), rtol=1e-5, atol=1e-6)


def test_autocast_runs_the_head_in_the_autocast_dtype() -> None:
    h, w, b = _inputs(16, 8, 70, torch.float32, True, 5)
    y = torch.randint(0, 70, (16,))
    leaves = [h, w] + ([b] if b is not None else [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = linear_cross_entropy(h, w, b, y, chunk_rows=5)
        plain = _plain(h, w, b, y)
    assert mine.dtype == plain.dtype == torch.float32
    torch.testing.assert_close(mine, plain, rtol=1e-5, atol=1e-5)
    for leaf, a, e in zip(leaves, _grads(mine, leaves), _grads(plain, leaves), strict=True):
        assert a.dtype == e.dtype == leaf.dtype == torch.float32
        scale = float(e.abs().max())
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2 * scale)


def test_a_second_backward_is_refused_by_autograd() -> None:
    h, w, _ = _inputs(5, 4, 9, torch.float32, False, 6)
    loss = linear_cross_entropy(h, w, None, torch.arange(5))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace operation"):
        loss.backward()


def test_a_gradient_of_the_gradient_is_refused_not_wrong() -> None:
    h, w, _ = _inputs(5, 4, 9, torch.float32, False, 7)
    loss = linear_cross_entropy(h, w, None, torch.arange(5))
    with pytest.raises(ts.InvalidArgumentError, match="create_graph"):
        torch.autograd.grad(loss, h, create_graph=True)


def _bad_calls() -> list[tuple[str, dict[str, Any], type[Exception], str]]:
    return [
        ("hidden", {"hidden": [1.0]}, ts.ArgumentTypeError, "must be a tensor"),
        (
            "int hidden",
            {"hidden": torch.ones(4, 3, dtype=torch.long)},
            ts.ArgumentTypeError,
            "float",
        ),
        ("float target", {"target": torch.zeros(4)}, ts.ArgumentTypeError, "class indices"),
        ("3-D hidden", {"hidden": torch.randn(2, 2, 3)}, ts.InvalidArgumentError, "flatten"),
        ("width", {"weight": torch.randn(10, 4)}, ts.InvalidArgumentError, r"\[V, H\]"),
        ("bias", {"bias": torch.randn(9)}, ts.InvalidArgumentError, "bias"),
        ("rows", {"target": torch.zeros(5, dtype=torch.long)}, ts.InvalidArgumentError, r"\(5,\)"),
        ("dtype", {"weight": torch.randn(10, 3).double()}, ts.InvalidArgumentError, "dtypes"),
        ("none", {"reduction": "none"}, ts.InvalidArgumentError, "'mean' or 'sum'"),
        ("smooth", {"label_smoothing": 1.5}, ts.InvalidArgumentError, r"\[0, 1\]"),
        ("chunk", {"chunk_rows": 0}, ts.InvalidArgumentError, "chunk_rows"),
        ("cap", {"softcap": 0.0}, ts.InvalidArgumentError, "softcap"),
        ("range", {"target": torch.tensor([0, 1, 10, 2])}, ts.InvalidArgumentError, "10 is out"),
        ("negative", {"target": torch.tensor([0, -3, 1, 2])}, ts.InvalidArgumentError, "-3"),
        ("device", {"weight": torch.randn(10, 3, device="meta")}, ts.InvalidArgumentError, "meta"),
    ]


@pytest.mark.parametrize(("case", "change", "error", "match"), _bad_calls())
def test_bad_inputs_raise_clear_errors(
    case: str, change: dict[str, Any], error: type[Exception], match: str
) -> None:
    call: dict[str, Any] = {
        "hidden": torch.randn(4, 3),
        "weight": torch.randn(10, 3),
        "bias": None,
        "target": torch.tensor([0, 1, 2, 3]),
    }
    call |= change
    with pytest.raises(error, match=match):
        linear_cross_entropy(**call)


def _largest_storage_and_peak(loss_fn: Any, n: int, hidden: int, vocab: int) -> tuple[int, int]:
    h, w, _ = _inputs(n, hidden, vocab, torch.float32, False, 8)
    y = torch.randint(0, vocab, (n,))
    with ts.record() as rec:
        loss_fn(h, w, None, y).backward()
    plan = rec.plan()
    made = [life.nbytes for life in plan.lifetimes if life.created >= 0]
    return max(made), plan.peak_bytes


def test_the_logits_never_exist_whole() -> None:
    n, hidden, vocab = 512, 16, 4096  # 8 MiB of float32 logits; W is 256 KiB
    logits = n * vocab * 4
    rows = 64  # a chunk's logits: 1 MiB

    def chunked(*args: Any) -> torch.Tensor:
        return linear_cross_entropy(*args, chunk_rows=rows)

    plain_largest, plain_peak = _largest_storage_and_peak(_plain, n, hidden, vocab)
    largest, peak = _largest_storage_and_peak(chunked, n, hidden, vocab)
    assert plain_largest >= logits  # what the recording would see if the logits existed
    assert largest <= rows * vocab * 4  # one chunk at most
    # the step's inputs, its two gradients, and a few chunks: never one N x V buffer
    inputs = (n * hidden + vocab * hidden) * 4 + n * 8
    assert peak <= 2 * inputs + 3 * rows * vocab * 4 < logits
    assert plain_peak - peak >= 2 * logits


def test_chunk_rows_from_bytes() -> None:
    assert chunk_rows_for(32000) == (32 << 20) // (4 * 32000)
    assert chunk_rows_for(1000, nbytes=4000 * 7) == 7
    assert chunk_rows_for(1000, nbytes=1) == 1
