"""Disposing a tensor never breaks a live alias of it: a view kept beyond its base's scope, the
source of a ``detach()`` made in a nested scope, views of one base disposed together.

A tensor, its views, its ``detach()`` aliases and autograd's saved copies share one version
counter, which disposal poisons so that backward over a disposed saved tensor raises
(docs/design.md §3). These are the cases where another, live tensor shares that counter: it must
keep its data, its graph and its gradients exactly as in plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tensorscope as ts


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 6)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _plain_last_row_grads() -> list[torch.Tensor]:
    model = _linear()
    torch.manual_seed(1)
    model(torch.randn(3, 4))[-1].sum().backward()
    return _grads(model)


def test_a_view_returned_from_a_scoped_function_keeps_its_gradient() -> None:
    """``@ts.scope()`` returning ``out[-1]``: the base is disposed with the function's scope,
    the view moves to the caller's scope, and backward through it reaches the parameters."""
    model = _linear()

    @ts.scope()
    def last_row(x: torch.Tensor) -> torch.Tensor:
        return model(x)[-1]

    torch.manual_seed(1)
    with ts.scope():
        last_row(torch.randn(3, 4)).sum().backward()
    grads = _grads(model)
    assert len(grads) == 2, "the gradient was lost"
    for got, expected in zip(grads, _plain_last_row_grads(), strict=True):
        assert torch.equal(got, expected)


def test_a_view_kept_with_detach_from_scope_backprops_after_the_scope() -> None:
    """The input is made outside (a scope-made input that autograd saved is disposed: backward
    over it raises, as the test below checks); the base of the kept view is disposed."""
    model = _linear()
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    with ts.scope():
        row = model(x)[-1].detach_from_scope()
    row.sum().backward()
    for got, expected in zip(_grads(model), _plain_last_row_grads(), strict=True):
        assert torch.equal(got, expected)
    assert not row.is_disposed


def test_disposing_a_detach_alias_leaves_its_source_and_the_graph_intact() -> None:
    """``d = h.detach()`` in a nested scope (a logging helper between forward and backward):
    disposing ``d`` must not touch ``h``, which autograd saved for the outer backward."""

    def run(scoped: bool) -> list[torch.Tensor]:
        model = _linear()
        torch.manual_seed(1)
        x = torch.randn(2, 4)
        outer = ts.scope() if scoped else torch.enable_grad()
        with outer:
            h = model(x).tanh()  # tanh saves its output h
            loss = h.pow(2).sum()  # pow saves h
            inner = ts.scope() if scoped else torch.enable_grad()
            with inner:
                d = h.detach()
                d.abs().mean().item()
            loss.backward()
        return _grads(model)

    for got, expected in zip(run(True), run(False), strict=True):
        assert torch.equal(got, expected)


def test_views_of_one_base_disposed_together_close_without_error() -> None:
    """``split`` outputs (views of one base that requires grad) all disposed at one exit."""
    w = torch.randn(4, 6, requires_grad=True)
    with ts.scope():
        q, k = (torch.ones(2, 4) @ w).split(3, dim=1)
        (q * k).sum().item()
    assert q.is_disposed and k.is_disposed


def test_backward_over_a_disposed_saved_input_uses_what_the_graph_kept() -> None:
    """The disposed input of ``mm`` stays with the graph of the moved loss (docs/api.md §8)."""
    w = torch.randn(4, 4, requires_grad=True)
    x_plain = torch.randn(3, 4)
    with ts.scope():
        with ts.scope():
            x = x_plain.clone()
            loss = (x @ w).sum().move_to_outer()
        assert x.is_disposed
        loss.backward()
    assert torch.equal(w.grad, x_plain.sum(0, keepdim=True).t().expand(4, 4))


C_LEVEL_READS = {
    "torch.tensor(t)": lambda t: torch.tensor(t),
    "torch.Tensor(t)": lambda t: torch.Tensor(t),
    "t.as_subclass(torch.Tensor)": lambda t: t.as_subclass(torch.Tensor),
    "torch.empty(0).set_(t)": lambda t: torch.empty(0).set_(t),
}


@pytest.mark.filterwarnings("ignore:To copy construct")
@pytest.mark.parametrize("read", list(C_LEVEL_READS))
def test_a_disposed_ref_read_from_cpp_raises(read: str) -> None:
    """Paths that reach the tensor without Python's attribute lookup raise DisposedTensorError
    on both engines: the disposed handle's stand-in TensorImpl carries the Python dispatch key
    (ref.py's NOTE on disposal)."""
    with ts.scope():
        loss = torch.tensor(1.25) * 2
    with pytest.raises(ts.DisposedTensorError, match=r"shape \(\) and dtype float32"):
        C_LEVEL_READS[read](loss)
