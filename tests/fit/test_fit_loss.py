"""The large-vocabulary loss under ts.fit: F.cross_entropy's gradient written over its saved
log-probabilities -- the same bits as the plain loss, one buffer of the logits' size less."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional

import tensorscope as ts
from tensorscope.fit import loss as loss_module
from tensorscope.fit.loss import LossMode, in_place_cross_entropy

from .fit_helpers import BIG_VOCAB, big_vocabulary, differing, step, twin

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40),
    v=st.integers(2, 300),
    rows_bytes=st.sampled_from([1, 64, 1000, 1 << 20]),
    reduction=st.sampled_from(["mean", "sum"]),
    ignored=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_same_bits_as_cross_entropy(
    n: int, v: int, rows_bytes: int, reduction: str, ignored: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[: min(ignored, n)] = -100
    scale = torch.rand((), generator=g) + 0.5
    old = loss_module._ROWS_BYTES
    loss_module._ROWS_BYTES = rows_bytes  # blocks of one row up to all rows
    try:
        mine = in_place_cross_entropy(x, t, reduction)
        (g_mine,) = torch.autograd.grad(mine * scale, x)
    finally:
        loss_module._ROWS_BYTES = old
    plain = functional.cross_entropy(x, t, reduction=reduction)
    (g_plain,) = torch.autograd.grad(plain * scale, x)
    assert torch.equal(mine, plain) or (mine.isnan() and plain.isnan())
    assert torch.equal(g_mine, g_plain) or (g_mine.isnan().all() and g_plain.isnan().all())


def _backward_peak(fn: Any) -> int:
    x = torch.randn(512, 4096, requires_grad=True)  # 8 MiB of logits
    t = torch.randint(0, 4096, (512,))
    with ts.record() as rec:
        fn(x, t).backward()
    return rec.plan().peak_bytes


def test_one_buffer_of_the_logits_size_less() -> None:
    plain = _backward_peak(functional.cross_entropy)
    mine = _backward_peak(in_place_cross_entropy)
    logits = 512 * 4096 * 4
    assert plain - mine >= logits - 2 * loss_module._ROWS_BYTES


def test_a_second_backward_is_refused_by_autograd() -> None:
    x = torch.randn(8, 10, requires_grad=True)
    loss = in_place_cross_entropy(x, torch.arange(8))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace operation"):
        loss.backward()


def test_a_gradient_of_the_gradient_is_refused_not_wrong() -> None:
    x = torch.randn(8, 10, requires_grad=True)
    loss = in_place_cross_entropy(x, torch.arange(8))
    with pytest.raises(ts.InvalidArgumentError, match="create_graph"):
        torch.autograd.grad(loss, x, create_graph=True)


def test_the_mode_routes_only_the_plain_form() -> None:
    x = torch.randn(300, 1000, requires_grad=True)  # 1.1 MiB: large enough
    t = torch.randint(0, 1000, (300,))
    with LossMode() as mode:
        functional.cross_entropy(x, t)
        functional.cross_entropy(x, t, label_smoothing=0.1)
        functional.cross_entropy(x, t, weight=torch.ones(1000))
        functional.cross_entropy(x[:10], t[:10])  # small
        functional.cross_entropy(x.detach(), t)  # no gradient wanted
        with torch.no_grad():
            functional.cross_entropy(x, t)
    assert mode.routed == 1 and mode.shape == (300, 1000)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fit_routes_a_large_vocabulary_loss_and_trains_like_plain(name: str) -> None:
    vocab = BIG_VOCAB
    model = big_vocabulary(name)
    ref = twin(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget="1GiB")
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        ids = torch.randint(0, vocab, (4, 32), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        assert step(model, opt, batch, seed=i) == step(ref, ropt, batch, seed=i)
        assert not differing(model, ref)
    assert fit.loss_routed == 4
    rows, columns = fit.loss_shape
    assert rows in (4 * 31, 4 * 32) and columns == vocab  # labels shifted, or padded
    assert f"loss: cross_entropy over {rows} x {vocab} logits" in fit.explain()
    fit.remove()


@pytest.mark.parametrize("autocast", [False, True])
def test_half_precision_logits_give_the_same_bits(autocast: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 4000, requires_grad=True)
    h = torch.randn(300, 64, requires_grad=True)
    t = torch.randint(0, 4000, (300,))

    def run(routed: bool) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = h @ w if autocast else h.bfloat16() @ w.bfloat16()
            with LossMode() if routed else contextlib.nullcontext() as mode:
                loss = functional.cross_entropy(logits, t)
            if routed:
                assert mode is not None and mode.routed == 1
        return [loss, *torch.autograd.grad(loss, (h, w))]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))


def test_fit_under_autocast_trains_like_plain() -> None:
    model = big_vocabulary("gpt2")
    ref = twin(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget="1GiB")
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        ids = torch.randint(0, BIG_VOCAB, (4, 32), generator=g)
        losses = []
        for net, o in ((model, opt), (ref, ropt)):
            torch.manual_seed(i)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
        assert not differing(model, ref)
    assert fit.loss_routed == 3
    fit.remove()
