"""``ts.fit(..., compile=True)``: the blocks' forwards compiled inside the chain (a recomputed
block reruns its compiled forward), the model's forward around it; results allclose to the plain
loop's; no compile once the decision has settled; a block that does not compile whole, the
user's own compile, a new sequence length, remove() (NOTE [compile=True],
fit/parts/compiled.py). Most tests compile with a counting backend that runs Dynamo's graphs as
traced; one compiles with inductor."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.errors import ArgumentTypeError
from tensorscope.fit.parts import compiled

from .fit_helpers import MLPChain, batches, loss_of, optimizer, plain_peak, tiny, twin

STEPS = 8


class CountingBackend:
    """Runs Dynamo's graphs as traced; counts the graphs it was given and the calls of those
    that hold a block (``marker`` in their code)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.graphs = 0
        self.block_calls = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        if self.marker not in gm.code:
            return gm.forward

        def run(*args: Any) -> Any:
            self.block_calls += 1
            return gm.forward(*args)

        return run


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingBackend]:
    torch._dynamo.reset()
    counting = CountingBackend("c_attn")  # GPT-2's attention projection: a block's graph
    monkeypatch.setattr(compiled, "BACKEND", counting)
    yield counting
    torch._dynamo.reset()


def close(losses: list[tuple[float, float]]) -> None:
    for k, (a, b) in enumerate(losses):
        assert a == pytest.approx(b, rel=1e-5), f"step {k + 1}: {a} vs {b}"


@pytest.mark.engine_independent
def test_compile_takes_a_bool() -> None:
    net = nn.Linear(4, 4)
    with pytest.raises(ArgumentTypeError, match=r"compile=\.\.\.\) takes a bool"):
        ts.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), budget="1MiB", compile=1)  # type: ignore[arg-type]
    assert not net._forward_pre_hooks  # nothing attached


@pytest.mark.slow
def test_blocks_run_compiled_recomputed_too_and_stop_compiling(backend: CountingBackend) -> None:
    budget = int(plain_peak("gpt2", "adamw") * 0.6)  # some blocks recomputed
    model = tiny("gpt2")
    ref = twin(model)
    graphs: list[int] = []
    calls: list[int] = []

    def after(k: int) -> None:
        graphs.append(backend.graphs)
        calls.append(backend.block_calls)

    # 4 blocks under a recompile limit of 4: a graph per grad mode and per input needing grad
    # or not (block 0) serves every block; one per block and grad mode would be 8
    with torch._dynamo.config.patch(recompile_limit=4):
        opt = optimizer("adamw", model)
        fit = ts.fit(model, opt, budget=budget, compile=True)
        try:
            losses = train(model, opt, ref, "gpt2", STEPS, after)
            close(losses)
            decision = fit.decision
            assert decision is not None and "recompute" in decision.blocks
            assert graphs[0] == 0  # step 1 ran eagerly (measured)
            assert graphs[1] > 0  # step 2 compiled
            assert graphs[2:] == [graphs[2]] * (STEPS - 2), graphs  # then nothing more
            # every block ran compiled, once in the forward and once more when recomputed
            recomputed = decision.blocks.count("recompute")
            assert calls[-1] - calls[-2] == len(decision.blocks) + recomputed
            assert fit.plan_after is not None
            text = fit.explain()
            assert "compile=True (torch.compile" in text
            assert "allclose to the plain loop's, not bit-identical" in text
        finally:
            fit.remove()
    assert "forward" not in model.__dict__
    assert not any("forward" in b.__dict__ for b in model.transformer.h)  # type: ignore[union-attr]


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    ref: nn.Module,
    name: str,
    steps: int,
    after: Callable[[int], None],
    seqs: list[int] | None = None,
) -> list[tuple[float, float]]:
    """``steps`` steps of the fitted ``model`` and its plain twin ``ref`` on the same batches
    (of length ``seqs[k]``); the pairs of losses."""
    ref_opt = optimizer("adamw", ref)
    streams: dict[int, tuple[Iterator[Any], Iterator[Any]]] = {}
    losses = []
    for k in range(steps):
        seq = seqs[k] if seqs is not None else 32
        if seq not in streams:
            streams[seq] = (batches(name, seq), batches(name, seq))
        pair = []
        for m, o, d in ((model, opt, streams[seq][0]), (ref, ref_opt, streams[seq][1])):
            torch.manual_seed(k)
            loss = loss_of(m, next(d))
            loss.backward()
            o.step()
            o.zero_grad()
            pair.append(loss.item())
        losses.append((pair[0], pair[1]))
        after(k)
    return losses


@pytest.mark.slow
def test_a_new_sequence_length_compiles_once_and_is_decided_again(
    backend: CountingBackend,
) -> None:
    budget = int(plain_peak("gpt2", "adamw", seq=48) * 0.6)
    model = tiny("gpt2")
    ref = twin(model)
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget=budget, compile=True)
    graphs: list[int] = []
    seqs = [32] * 5 + [48] * 6 + [40] * 2
    try:
        losses = train(
            model, opt, ref, "gpt2", len(seqs), lambda k: graphs.append(backend.graphs), seqs
        )
        close(losses)
        assert any("the batch grew" in note for note in fit.notes)  # measured, decided again
        assert graphs[5] == graphs[4]  # the longer step is measured: eager
        assert graphs[6] > graphs[5]  # then compiled once more, with a dynamic length
        assert graphs[7:] == [graphs[7]] * (len(seqs) - 7), graphs  # no more, not for 40 either
        assert fit.plan_after is not None
        assert fit.measured_peak(fit.plan_after) <= fit.budget_bytes
    finally:
        fit.remove()


class BrokenBlock(nn.Module):
    """A block whose forward breaks Dynamo's graph (a value read as a Python number)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, width)  # the backend's marker
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c_attn(x))
        scale = float(h.detach().abs().mean()) + 1.0  # a graph break
        return x + self.out(h) / scale


def test_a_block_that_breaks_its_graph_runs_the_plan_and_is_said(backend: CountingBackend) -> None:
    torch.manual_seed(0)
    model = MLPChain(width=32, depth=4).train()
    model.layers = nn.ModuleList(BrokenBlock(32) for _ in range(4))
    ref = twin(model)
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget="64MiB", compile=True)
    try:
        close(train(model, opt, ref, "mlp", 5, lambda k: None))
        assert fit.decision is not None
        text = fit.explain()
        assert "does not compile whole" in text and "graph break" in text
        assert backend.block_calls > 0  # the pieces that compile ran compiled
    finally:
        fit.remove()


@pytest.mark.slow
@pytest.mark.parametrize("order", ["compile_then_fit", "fit_then_compile", "wrapper_fitted"])
def test_the_users_own_compile_with_compile_true(backend: CountingBackend, order: str) -> None:
    budget = int(plain_peak("gpt2", "adamw") * 0.6)
    model = tiny("gpt2")
    ref = twin(model)
    opt = optimizer("adamw", model)
    run = model
    if order == "compile_then_fit":
        model.compile(backend=backend)
        fit = ts.fit(model, opt, budget=budget, compile=True)
    elif order == "fit_then_compile":
        fit = ts.fit(model, opt, budget=budget, compile=True)
        model.compile(backend=backend)
    else:  # torch.compile's wrapper given to ts.fit
        run = torch.compile(model, backend=backend)  # type: ignore[assignment]
        fit = ts.fit(run, opt, budget=budget, compile=True)
    graphs: list[int] = []
    try:
        close(train(run, opt, ref, "gpt2", 6, lambda k: graphs.append(backend.graphs)))
        assert graphs[-1] == graphs[-3], graphs  # settled
        assert backend.block_calls > 0  # the blocks ran compiled
        said = "compiled by its user" in fit.explain()
        assert said == (order != "fit_then_compile")
        assert fit.decision is not None and "recompute" in fit.decision.blocks
    finally:
        fit.remove()
    assert "forward" not in model.__dict__


def test_remove_gives_the_uncompiled_model_back(backend: CountingBackend) -> None:
    model = tiny("gpt2")
    ref = twin(model)
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget="64MiB", compile=True)
    train(model, opt, ref, "gpt2", 3, lambda k: None)
    fit.remove()
    calls = backend.block_calls
    batch = next(batches("gpt2"))
    torch.manual_seed(5)
    mine = loss_of(model, batch)
    torch.manual_seed(5)
    theirs = loss_of(ref, batch)
    assert backend.block_calls == calls  # nothing compiled runs any more
    assert "forward" not in model.__dict__
    assert torch.equal(mine, theirs)  # the same weights (three equal steps), the same bits


@pytest.mark.slow
def test_inductor_on_a_tiny_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    torch._dynamo.reset()
    monkeypatch.setattr(compiled, "BACKEND", "inductor")
    torch.manual_seed(0)
    model = MLPChain(width=16, depth=3).train()
    ref = twin(model)
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget="64MiB", compile=True)
    try:
        close(train(model, opt, ref, "mlp", 4, lambda k: None))
        assert "backend inductor" in fit.explain()
    finally:
        fit.remove()
        torch._dynamo.reset()
