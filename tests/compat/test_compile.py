"""``torch.compile`` under tensorscope (item 3).

The backend must receive the same graphs (count and ops) inside a scope as outside; compiled code
must run compiled inside and outside scopes, whichever side compiled it; its results are equal to
the plain ones bit for bit (same backend) and, inside a scope, owned by the scope. The counting
backend returns ``gm.forward`` wrapped to count how often compiled graphs run: a module that
silently falls back to eager runs no compiled graph. conftest.py resets dynamo after each test.
"""

from __future__ import annotations

import dataclasses
import operator
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import fx, nn

import tensorscope as ts

from . import _models as M


@dataclasses.dataclass
class CountingBackend:
    """A dynamo backend that records each graph it receives and counts compiled runs."""

    graphs: list[list[str]] = dataclasses.field(default_factory=list)
    runs: int = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        self.graphs.append(
            [
                str(node.target)
                for node in gm.graph.nodes
                if node.op in ("call_function", "call_method", "call_module")
            ]
        )
        forward = gm.forward

        def run(*args: object) -> object:
            self.runs += 1
            return forward(*args)

        return run

    @property
    def ops(self) -> int:
        return sum(len(g) for g in self.graphs)


def small_mlp() -> nn.Module:
    return M.mlp(depth=2)


def inputs() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(3))


def free_function(x: torch.Tensor) -> torch.Tensor:
    y = torch.sin(x) * x + x.exp().clamp(max=4)
    return F.layer_norm(y, y.shape[-1:]) @ y.T


def _compile_and_call(
    make: Callable[[], Callable[[torch.Tensor], torch.Tensor]], scoped: bool
) -> tuple[CountingBackend, torch.Tensor]:
    torch._dynamo.reset()
    backend = CountingBackend()
    fn = torch.compile(make(), backend=backend)
    if scoped:
        with ts.scope():
            out = M.plain_copy(fn(inputs()))
    else:
        out = fn(inputs())
    return backend, out


TARGETS: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "mlp": small_mlp,
    "function": lambda: free_function,
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_backend_receives_the_same_graphs_inside_a_scope(target: str) -> None:
    outside, expected = _compile_and_call(TARGETS[target], scoped=False)
    assert len(outside.graphs) == 1 and outside.ops > 0
    inside, result = _compile_and_call(TARGETS[target], scoped=True)
    assert inside.graphs == outside.graphs  # same count, same ops, in the same order
    assert inside.runs == outside.runs
    assert torch.equal(result, expected)


def test_hf_model_graphs_inside_a_scope_match() -> None:
    """GPT-2's forward: the graphs (and graph breaks) dynamo makes do not depend on a scope."""
    name = "gpt2"
    ids = M.batch(name, 0)["input_ids"]

    def make() -> Callable[[torch.Tensor], torch.Tensor]:
        model = M.build(name).eval()
        return lambda x: model(input_ids=x, use_cache=False).logits

    def call(scoped: bool) -> tuple[CountingBackend, torch.Tensor]:
        torch._dynamo.reset()
        backend = CountingBackend()
        fn = torch.compile(make(), backend=backend)
        with torch.no_grad():
            if scoped:
                with ts.scope():
                    return backend, M.plain_copy(fn(ids))
            return backend, fn(ids)

    outside, expected = call(False)
    assert outside.graphs
    inside, result = call(True)
    assert len(inside.graphs) == len(outside.graphs)
    assert inside.ops == outside.ops
    assert inside.graphs == outside.graphs
    assert torch.equal(result, expected)


INPUT_MADE = ("input_made_inside", "input_made_outside")


def _call(model: Callable[[torch.Tensor], torch.Tensor], made: str, x: torch.Tensor) -> object:
    """Call ``model`` in a scope on an input made inside the scope or (``x``) before it."""
    with ts.scope():
        return M.plain_copy(model(inputs() if made == "input_made_inside" else x))


@pytest.mark.parametrize("made", INPUT_MADE)
def test_compiled_outside_runs_compiled_inside_a_scope(made: str) -> None:
    """The compiled graph runs inside the scope: no fallback to eager, no graph-break graphs.

    A recompile that hands the backend the very same graph is tolerated here (see the next
    test); what must not happen is eager execution or a different (broken-up) graph.
    """
    backend = CountingBackend()
    model = torch.compile(small_mlp(), backend=backend)
    x = inputs()
    expected = model(x)
    assert len(backend.graphs) == 1 and backend.runs == 1
    for call in range(2):
        assert torch.equal(_call(model, made, x), expected)
        assert backend.runs == 2 + call, "the compiled graph did not run inside the scope"
    assert all(graph == backend.graphs[0] for graph in backend.graphs), "a different graph"
    assert torch.equal(model(x), expected)
    assert backend.runs == 4


@pytest.mark.parametrize("made", INPUT_MADE)
def test_compiled_outside_recompiles_at_most_once_inside_a_scope(made: str) -> None:
    """Inside a scope, a function compiled outside compiles at most once more, to the same
    graph, then runs compiled. Dynamo guards on the thread's dispatch keys (the C++ engine
    includes one while a scope is open) and on a tensor's Python type (an input made inside
    the scope is a ``TensorRef``): each state compiles once, then is cached."""
    backend = CountingBackend()
    model = torch.compile(small_mlp(), backend=backend)
    x = inputs()
    expected = model(x)
    for _ in range(3):
        assert torch.equal(_call(model, made, x), expected)
    assert len(backend.graphs) <= 2, "recompiled more than once inside the scope"
    assert all(graph == backend.graphs[0] for graph in backend.graphs), "a different graph"
    compiled = len(backend.graphs)
    assert torch.equal(model(x), expected)
    assert len(backend.graphs) == compiled and backend.runs == 5


def test_compiled_inside_a_scope_runs_compiled_outside() -> None:
    """Compiling (the first call) inside a scope must not leave the module eager afterwards."""
    backend = CountingBackend()
    model = torch.compile(small_mlp(), backend=backend)
    with ts.scope():
        expected = M.plain_copy(model(inputs()))
    assert len(backend.graphs) == 1 and backend.runs == 1
    assert torch.equal(model(inputs()), expected)
    assert backend.runs == 2, "the compiled graph did not run outside the scope"
    with ts.scope():
        assert torch.equal(model(inputs()), expected)
    assert backend.runs == 3
    assert all(graph == backend.graphs[0] for graph in backend.graphs), "a different graph"


def test_compiled_inside_a_scope_recompiles_at_most_once_outside() -> None:
    """Compiled inside a scope, called outside: at most one more compilation (see above), the
    same graph, then cached."""
    backend = CountingBackend()
    model = torch.compile(small_mlp(), backend=backend)
    with ts.scope():
        expected = M.plain_copy(model(inputs()))
    for _ in range(3):
        assert torch.equal(model(inputs()), expected)
    assert len(backend.graphs) == 2 and backend.graphs[0] == backend.graphs[1]
    assert backend.runs == 4


@pytest.mark.parametrize(
    "backend", ["counting", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
def test_compiled_results_are_owned_by_the_scope(backend: str) -> None:
    """Inductor allocates its outputs outside the dispatcher: they are owned all the same."""
    chosen = CountingBackend() if backend == "counting" else backend
    model = torch.compile(small_mlp(), backend=chosen)
    with torch.no_grad():
        expected = model(inputs())  # compiled before any scope: the graph is called inside
    with ts.scope() as scope:
        out = model(inputs())
        assert isinstance(out, ts.TensorRef)
        assert out.scope is scope
        assert torch.equal(out, expected)
    assert out.is_disposed


def _views_and_inputs(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return a.t(), a[1:], b, a * b, (a + 1).view(-1)


@pytest.mark.slow
def test_inductor_outputs_that_alias_inputs_leave_the_inputs_alive() -> None:
    """Views of inputs are owned as eager views are (disposing one frees nothing of its base);
    an input handed back unchanged stays the caller's."""
    compiled = torch.compile(_views_and_inputs, backend="inductor")
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    kept = x.clone()
    expected = _views_and_inputs(x, x + 1)
    with ts.scope():
        b = x + 1
        outs = compiled(x, b)
        assert outs[2] is b
        for got, want in zip(outs, expected, strict=True):
            assert type(got) is ts.TensorRef
            assert torch.equal(got, want)
    assert type(x) is torch.Tensor and torch.equal(x, kept)
    assert all(out.is_disposed for out in outs if out is not b)
    first = _views_and_inputs.__code__.co_firstlineno  # the site is in the compiled function
    lines = f"({first}|{first + 1})"
    with pytest.raises(ts.DisposedTensorError, match=f"created at {__file__}:{lines},"):
        outs[3] + 1


_COMPILED_BEFORE_IMPORT = """
import torch, torch._dynamo
f = torch.compile(lambda x: x.sin() * 2, backend="inductor")
import tensorscope as ts
g = torch.compile(lambda x: x.cos() + 1, backend="inductor")
g(torch.ones(3))  # compiled before any scope, after the import
with ts.scope():
    print(type(g(torch.ones(3))).__name__)
"""


@pytest.mark.slow
def test_inductor_outputs_are_owned_when_dynamo_was_imported_first() -> None:
    """Dynamo loaded before tensorscope: the wrapper is applied at import, not only lazily."""
    done = subprocess.run(
        [sys.executable, "-c", _COMPILED_BEFORE_IMPORT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["TensorRef"]


def _train_compiled(
    backend: object, scoped: bool, steps: int = 3
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch._dynamo.reset()
    model = small_mlp()
    compiled = torch.compile(model, backend=backend)
    run = M.Run("scope" if scoped else "plain")
    losses = M.mlp_train(compiled, M.mlp_batches(steps), run.step)
    return losses, M.state_of(model)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "counting"])
def test_compiled_training_in_scopes_matches_unscoped(backend: str) -> None:
    """Forward compiled (aot_eager also compiles the backward graph), 3 Adam steps."""
    unscoped_backend = CountingBackend() if backend == "counting" else backend
    expected_losses, expected_state = _train_compiled(unscoped_backend, scoped=False)
    scoped_backend = CountingBackend() if backend == "counting" else backend
    losses, state = _train_compiled(scoped_backend, scoped=True)
    assert losses == expected_losses
    for key, value in state.items():
        assert torch.equal(value, expected_state[key]), key
    if isinstance(scoped_backend, CountingBackend):
        assert isinstance(unscoped_backend, CountingBackend)
        assert unscoped_backend.graphs and unscoped_backend.runs == 3
        assert scoped_backend.graphs == unscoped_backend.graphs
        assert scoped_backend.runs == unscoped_backend.runs
    # The compiled run also matches eager training. Bit for bit with the "eager" and counting
    # backends (they run the captured graph as is); aot_eager runs the graph that AOTAutograd
    # traced, whose decomposed kernels may round differently from eager ones.
    eager_losses = M.mlp_train(small_mlp(), M.mlp_batches(3), M.Run("plain").step)
    if backend == "aot_eager":
        torch.testing.assert_close(losses, eager_losses)
    else:
        assert losses == eager_losses


def test_counting_backend_counts_graph_breaks_the_same_way() -> None:
    """A function with a graph break: two graphs outside a scope, and the same two inside."""

    def broken(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() * 2
        torch._dynamo.graph_break()
        return operator.add(y.cos(), 1)

    outside, expected = _compile_and_call(lambda: broken, scoped=False)
    assert len(outside.graphs) == 2
    inside, result = _compile_and_call(lambda: broken, scoped=True)
    assert inside.graphs == outside.graphs
    assert torch.equal(result, expected)


@pytest.mark.slow
def test_inductor_training_in_scopes_matches_unscoped() -> None:
    expected_losses, expected_state = _train_compiled("inductor", scoped=False, steps=2)
    losses, state = _train_compiled("inductor", scoped=True, steps=2)
    assert losses == expected_losses
    for key, value in state.items():
        assert torch.equal(value, expected_state[key]), key


def _compiled_loss_grads(backend: str, scoped: bool, call: str) -> list[torch.Tensor]:
    """The loss is the compiled function's own output; backward as ``call`` says."""
    torch._dynamo.reset()
    model = small_mlp()
    loss_of = torch.compile(lambda x: model(x).pow(2).mean(), backend=backend)
    for _ in range(2):
        with ts.scope() if scoped else torch.enable_grad():
            loss = loss_of(inputs())
            if call == "method":
                loss.backward()
            elif call == "function":
                torch.autograd.backward(loss)
            else:  # an explicit gradient made inside the scope (a ref)
                loss.backward(torch.ones_like(loss))
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("call", ["method", "function", "explicit_gradient"])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_backward_of_a_compiled_loss_in_a_scope_matches_unscoped(backend: str, call: str) -> None:
    """The compiled backward checks the exact type of the incoming gradient: a gradient made in
    the scope (a ref) is handed over as a plain alias (``__coerce_same_metadata_as_tangent__``)."""
    expected = _compiled_loss_grads(backend, scoped=False, call=call)
    got = _compiled_loss_grads(backend, scoped=True, call=call)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_managed_module_with_a_buffer_compiles(backend: str) -> None:
    """Managed parameters and buffers reach AOTAutograd as plain tensors do."""
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    expected = _WithBuffer()(x)
    model = _WithBuffer()
    ts.residency.configure(device="cpu", policy="flow", budget=None)
    with ts.manage(model):
        out = torch.compile(model, backend=backend)(x)
        assert torch.equal(out, expected)
