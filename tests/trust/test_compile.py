"""#5: torch.compile and scopes. Compiled code must reach the backend (the same graphs as without
a scope), run compiled inside and outside scopes, and its results must be owned by the scope.

The backend records each graph it is given (its generated code) and counts the calls of the
compiled code, so "ran compiled" is observed directly. dynamo is reset around each test: a
graph cached by one test cannot make another pass or fail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


Graph = list[tuple[str, str]]


class RecordingBackend:
    """A torch.compile backend that keeps each graph's nodes (op kind and target) and counts
    the calls of the compiled code."""

    def __init__(self) -> None:
        self.graphs: list[Graph] = []
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append([(node.op, str(node.target)) for node in gm.graph.nodes])

        def compiled(*args: Any) -> Any:
            self.calls += 1
            return gm.forward(*args)

        return compiled


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _input() -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


def _graphs_and_output_outside_scopes() -> tuple[list[Graph], torch.Tensor]:
    import torch._dynamo

    backend = RecordingBackend()
    out = torch.compile(_model(), backend=backend)(_input())
    torch._dynamo.reset()
    return backend.graphs, out.detach()


def test_compiling_inside_a_scope_gives_the_backend_the_same_graphs_as_outside() -> None:
    """#5: compiled in a scope: same graphs as outside, runs compiled, result owned by the scope."""
    expected_graphs, expected = _graphs_and_output_outside_scopes()
    assert expected_graphs, "test setup: nothing compiled without a scope"
    backend = RecordingBackend()
    compiled = torch.compile(_model(), backend=backend)
    x = _input()
    with ts.scope() as s:
        out = compiled(x)
        assert torch.equal(out, expected)
        owned = isinstance(out, ts.TensorRef) and out in s
    assert backend.graphs == expected_graphs
    assert backend.calls == 1, "the compiled code did not run inside the scope"
    assert owned, "the compiled code's result is not owned by the scope"


def test_a_module_compiled_inside_a_scope_runs_compiled_outside_scopes() -> None:
    """#5: a module first compiled inside a scope runs compiled outside scopes."""
    _, expected = _graphs_and_output_outside_scopes()
    backend = RecordingBackend()
    compiled = torch.compile(_model(), backend=backend)
    with ts.scope():
        compiled(_input())
    calls = backend.calls
    out = compiled(_input())
    assert torch.equal(out, expected)
    assert backend.calls == calls + 1, "the call outside the scope ran eagerly"


def test_a_module_compiled_outside_runs_compiled_inside_a_scope() -> None:
    """#5: a module compiled outside scopes runs compiled inside a scope."""
    _, expected = _graphs_and_output_outside_scopes()
    backend = RecordingBackend()
    compiled = torch.compile(_model(), backend=backend)
    compiled(_input())
    calls = backend.calls
    with ts.scope():
        out = compiled(_input())
        assert torch.equal(out, expected)
    assert backend.calls == calls + 1, "the call inside the scope ran eagerly"


def test_results_of_compiled_code_are_owned_by_the_scope() -> None:
    """#5: results of compiled code are refs of the scope, disposed at its exit."""
    backend = RecordingBackend()
    compiled = torch.compile(_model(), backend=backend)
    with torch.no_grad():
        compiled(_input())  # compiled outside
        calls = backend.calls
        with ts.scope() as s:
            out = compiled(_input())
            assert isinstance(out, ts.TensorRef) and out in s
        assert out.is_disposed
    assert backend.calls == calls + 1, "the call inside the scope ran eagerly"
