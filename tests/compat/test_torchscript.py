"""TorchScript inside scopes: ``torch.jit.script`` functions called in a loop of scopes, and
``torch.jit.trace`` of a function and of a module made inside a scope, used after it.

The graph executor optimises a function on its first calls and folds constants into the graph;
made inside a scope, those constants used to be owned and emptied at its exit, and every later
call computed with empty tensors (silently wrong results). See _thread.py's NOTE on TorchScript.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tensorscope as ts

from . import _models as M

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _scripted_source(x: torch.Tensor) -> torch.Tensor:
    return x.sum() + torch.ones(3).sum()


def _traced_fn(x: torch.Tensor) -> torch.Tensor:
    pad = torch.zeros(2)
    return torch.cat([x, pad]).sum() + torch.ones(3).sum()


class _Masked(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.tril(torch.ones(4, 4))


def _script() -> torch.jit.ScriptFunction:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.script(_scripted_source)


def test_a_scripted_function_in_a_loop_of_scopes_computes_like_plain() -> None:
    scripted = _script()
    plain = [float(_scripted_source(torch.full((4,), float(i)))) for i in range(4)]
    got = []
    for i in range(4):
        with ts.scope():
            got.append(float(scripted(torch.full((4,), float(i)))))
    assert got == plain
    assert float(scripted(torch.ones(4))) == 7.0  # optimised outside scopes, still right
    with ts.scope():
        assert float(scripted(torch.ones(4))) == 7.0


def test_torchscript_optimisation_is_restored_when_the_last_scope_closes() -> None:
    assert torch._C._get_graph_executor_optimize()
    with ts.scope():
        with ts.scope():
            assert not torch._C._get_graph_executor_optimize()
        assert not torch._C._get_graph_executor_optimize()
    assert torch._C._get_graph_executor_optimize()


def test_traces_made_inside_a_scope_work_after_it() -> None:
    x, rows = torch.ones(4), torch.ones(2, 4)
    with ts.scope():
        traced_fn = torch.jit.trace(_traced_fn, (x,))
        traced_module = torch.jit.trace(_Masked(), (rows,))
        inside = M.plain_copy(traced_fn(x))
    for _ in range(2):
        assert torch.equal(traced_fn(x), _traced_fn(x))
        assert torch.equal(traced_module(rows), _Masked()(rows))
    assert torch.equal(inside, _traced_fn(x))
