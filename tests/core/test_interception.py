"""The interceptor: what becomes a ref, what never does, and that torch is untouched outside."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope._state import STATES
from tensorscope._torch import scope_key_included


def test_no_scope_means_plain_torch() -> None:
    a = ts.ref(torch.ones(3))
    out = a + 1
    assert type(out) is torch.Tensor
    assert _interceptors() == 0


def _interceptors() -> int:
    """How many tensorscope interceptors are active on this thread (the Python mode on the
    dispatch stack, or the C++ engine's key)."""
    return torch._C._len_torch_dispatch_stack() + bool(scope_key_included())


def test_interception_is_on_only_while_scopes_are_open() -> None:
    assert _interceptors() == 0
    with ts.scope():
        assert _interceptors() == 1
        with ts.scope():
            assert _interceptors() == 1  # one per thread
    assert _interceptors() == 0
    # tensorscope pushes no saved-tensor hooks (torch.func refuses to run under them)
    with ts.scope():
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_every_kind_of_result_is_owned() -> None:
    with ts.scope() as s:
        base = torch.arange(12.0).reshape(3, 4)
        pieces = torch.split(base, 1)
        view = base.t()
        item = base[0]
        mx = base.max(dim=1)
    for t in (base, *pieces, view, item, mx.values, mx.indices):
        assert t.is_disposed
    assert s.is_closed


def test_inplace_and_out_results_record_nothing_new() -> None:
    outside = torch.zeros(3)
    with ts.scope() as s:
        r = outside.add_(1)
        assert r is outside and type(outside) is torch.Tensor
        out = torch.empty(3)
        before = len(s)
        res = torch.add(outside, 1, out=out)
        assert res is out and len(s) == before
    assert outside.tolist() == [1.0, 1.0, 1.0]


def test_parameters_and_buffers_created_in_a_scope_are_plain_and_survive() -> None:
    with ts.scope():
        lin = nn.Linear(3, 2)
        bn = nn.BatchNorm1d(2)
        p = nn.Parameter(torch.randn(2))
        buf = nn.Buffer(torch.ones(2))
    assert type(lin.weight) is nn.Parameter and type(p) is nn.Parameter
    assert type(bn.running_mean) is torch.Tensor
    assert isinstance(buf, nn.Buffer) and not isinstance(buf, ts.TensorRef)
    assert lin(torch.ones(1, 3)).shape == (1, 2)
    assert bn.running_var.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("entry", ["tensor.backward", "torch.autograd.backward"])
def test_grads_made_by_autograd_are_never_owned(entry: str) -> None:
    """``.grad``s are autograd's: plain whichever way backward is entered, accumulation
    included; the results of ``torch.autograd.grad`` are ordinary results (owned)."""
    w = nn.Parameter(torch.randn(3))
    x0 = torch.randn(3)
    with ts.scope() as s:
        x = x0.clone().requires_grad_()
        for _ in range(2):  # the second accumulates
            loss = (w * x * x).sum()
            if entry == "tensor.backward":
                loss.backward()
            else:
                torch.autograd.backward(loss)
            assert type(w.grad) is torch.Tensor and type(x.grad) is torch.Tensor
        (g,) = torch.autograd.grad((w * x).sum(), [x])
        assert isinstance(g, ts.TensorRef) and g.scope is s
    assert w.grad is not None and torch.allclose(w.grad, 2 * x0 * x0)
    assert x.is_disposed


def test_a_disposed_leaf_lets_go_of_its_grad() -> None:
    process_grad: list[torch.Tensor] = []
    with ts.scope():
        leaf = torch.randn(3, requires_grad=True)
        (leaf * 2).sum().backward()
        process_grad.append(leaf.grad)  # the user keeps the (plain) grad itself
        leaf.dispose()
    assert process_grad[0].tolist() == [2.0, 2.0, 2.0]  # a plain tensor the user holds
    kept = ts.ref(torch.randn(3, requires_grad=True))
    with ts.scope() as s:
        s.include(kept)
        (kept * 2).sum().backward()
        s.exclude(kept)
    assert kept.grad is not None and kept.grad.tolist() == [2.0, 2.0, 2.0]
    (kept * 3).sum().backward()
    assert kept.grad.tolist() == [5.0, 5.0, 5.0]


class _FailingSGD(torch.optim.SGD):
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        torch.ones(2)  # created inside the step: never owned
        raise RuntimeError("boom")


def test_optimizer_state_is_never_owned_and_the_mode_is_restored_after_a_failing_step() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    failing = _FailingSGD(model.parameters(), lr=0.1)
    with ts.scope() as s:
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        state = opt.state[model.weight]
        assert all(type(v) is torch.Tensor for v in state.values())
        with pytest.raises(RuntimeError, match="boom"):
            failing.step()
        # the next scope event puts the mode back; tensors are owned again
        with ts.scope() as inner:
            t = torch.ones(1)
            assert t.scope is inner
        u = torch.ones(1)
        assert u.scope is s
    assert _interceptors() == 0


def test_forward_without_backward_does_not_leak_graphs() -> None:
    w = nn.Parameter(torch.randn(16, 16))
    with ts.scope():
        before_states = len(STATES)
        for _ in range(200):
            h = torch.randn(4, 16)
            for _ in range(3):
                h = (h @ w).tanh()  # tanh saves its output
        del h
        assert len(STATES) - before_states < 20


def test_backward_through_a_graph_moved_out_of_its_scope_works() -> None:
    """docs/api.md §8: the graph of a moved tensor keeps what it saved (``h``), while ``h``
    itself is disposed."""
    w = nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3)
    (x @ w).tanh().mul(2).sum().backward()
    expected = w.grad.clone()
    w.grad = None
    with ts.scope(name="fwd"):
        h = (x @ w).tanh()
        out = (h * 2).sum().detach_from_scope()
    assert h.is_disposed
    with pytest.raises(ts.DisposedTensorError, match=r"\(2, 3\).*'fwd'"):
        h.sum()
    out.backward()
    assert torch.equal(w.grad, expected)


def test_scope_closed_from_another_thread_leaves_its_own_thread_usable() -> None:
    s = ts.scope()
    s.__enter__()
    x = torch.ones(2)
    worker = threading.Thread(target=s.close)
    worker.start()
    worker.join()
    assert x.is_disposed and s.is_closed
    y = torch.ones(2)  # the mode may still be pushed here, but it returns plain tensors
    assert type(y) is torch.Tensor
    with ts.scope():  # the next scope event of this thread cleans up
        pass
    assert _interceptors() == 0


def test_leak_warning_points_at_the_users_with_statement() -> None:
    import inspect

    keep: list[torch.Tensor] = []
    with pytest.warns(ts.LeakWarning) as caught:
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        with ts.scope(report_leaks=True):
            keep.append(torch.ones(3))
    assert caught[0].filename == __file__ and caught[0].lineno == line
