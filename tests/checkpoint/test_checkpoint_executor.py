"""Running schedules: gradients, RNG replay, BatchNorm statistics, and memory op by op."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from tensorscope.checkpoint import Chain, min_memory, solve, store_all_memory
from tensorscope.checkpoint import executor as executor_module
from tensorscope.checkpoint.chain import Op
from tensorscope.checkpoint.executor import Executor
from tensorscope.checkpoint.profile import measure
from tensorscope.checkpoint.simulate import Simulator
from tensorscope.checkpoint.tracker import StorageTracker
from tensorscope.errors import InvalidArgumentError

pytestmark = pytest.mark.engine_independent  # rotor runs plain torch ops (checked)

WIDTH = 32


def make_layers(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.3), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, 3))
    return layers


def schedules(layers: list[nn.Module], x: torch.Tensor) -> list[tuple[Op, ...]]:
    chain = measure(layers, x, repeats=1).to_chain()
    least, top = min_memory(chain), store_all_memory(chain)
    limits = [least, (least + top) // 2, top]
    return [solve(chain, limit, slots=200).ops for limit in limits]


def step(
    layers: list[nn.Module], ops: tuple[Op, ...] | None, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    torch.manual_seed(1)
    out = Executor(layers, ops)(x) if ops is not None else nn.Sequential(*layers)(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [p.grad for m in layers for p in m.parameters()]


@pytest.mark.parametrize("input_grad", [False, True])
def test_same_outputs_gradients_and_statistics_as_plain(input_grad: bool) -> None:
    x = torch.randn(16, WIDTH)
    plain = make_layers()
    ops_list = schedules(plain, x)
    assert len(ops_list[0]) > len(ops_list[2]) == 2 * len(plain) + 1  # recomputation vs none
    x_ref = x.clone().requires_grad_(input_grad)
    out_ref, grads_ref = step(plain, None, x_ref)
    for ops in ops_list:
        layers = make_layers()
        x_ck = x.clone().requires_grad_(input_grad)
        out, grads = step(layers, ops, x_ck)
        assert torch.equal(out, out_ref)  # dropout masks replayed
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))  # type: ignore[arg-type]
        if input_grad:
            assert torch.equal(x_ck.grad, x_ref.grad)  # type: ignore[arg-type]
        for m, m_ref in zip(layers, plain, strict=True):
            for b, b_ref in zip(m.buffers(), m_ref.buffers(), strict=True):
                assert torch.equal(b, b_ref)  # running stats updated once, not per recompute
        assert int(layers[1].num_batches_tracked) == 1  # type: ignore[arg-type]


def test_global_rng_stream_is_the_plain_models() -> None:
    x = torch.randn(16, WIDTH)
    plain = make_layers()
    ops = schedules(plain, x)[0]
    step(plain, None, x)
    after_plain = torch.rand(4)
    step(make_layers(), ops, x)
    assert torch.equal(torch.rand(4), after_plain)


def test_autograd_grad_and_shared_parameters() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    layers: list[nn.Module] = [shared, nn.Tanh(), shared, nn.Tanh()]
    x = torch.randn(4, 8)
    chain = measure(layers, x, repeats=1).to_chain()
    ops = solve(chain, min_memory(chain)).ops
    loss = Executor(layers, ops)(x).pow(2).sum()
    grads = torch.autograd.grad(loss, list(shared.parameters()))
    expected = torch.autograd.grad(
        nn.Sequential(*layers)(x).pow(2).sum(), list(shared.parameters())
    )
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)
    with pytest.raises(InvalidArgumentError, match="a second backward"):
        out = Executor(layers, ops)(x).sum()
        out.backward(retain_graph=True)
        out.backward()


def test_integer_input_and_autocast() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Embedding(10, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)]
    tokens = torch.randint(0, 10, (8, 5))
    chain = measure(layers, tokens, repeats=1).to_chain()
    ops = solve(chain, min_memory(chain)).ops
    assert ops.count(("Fck", 0)) + ops.count(("Fn", 1)) > 1  # layers really are recomputed
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Executor(layers, ops)(tokens)
    out.float().sum().backward()
    got = [p.grad.clone() for m in layers for p in m.parameters()]  # type: ignore[union-attr]
    for m in layers:
        m.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = nn.Sequential(*layers)(tokens)
    ref.float().sum().backward()
    assert out.dtype == ref.dtype == torch.bfloat16
    params = [p for m in layers for p in m.parameters()]
    for g, p in zip(got, params, strict=True):
        assert torch.equal(g, p.grad)  # type: ignore[arg-type]


@contextmanager
def op_recorder(
    record: Callable[[Op, executor_module._Run], None],
) -> Iterator[None]:
    run_cls = executor_module._Run
    forward_op, backward_op = run_cls.forward_op, run_cls.backward_op

    def fwd(self: executor_module._Run, kind: str, k: int) -> None:
        forward_op(self, kind, k)
        record((kind, k), self)

    def bwd(self: executor_module._Run, k: int) -> None:
        backward_op(self, k)
        record(("B", k), self)

    run_cls.forward_op, run_cls.backward_op = fwd, bwd  # type: ignore[method-assign]
    try:
        yield
    finally:
        run_cls.forward_op, run_cls.backward_op = forward_op, backward_op  # type: ignore[method-assign]


def live_mismatches(
    layers: list[nn.Module], x: torch.Tensor, chain: Chain, ops: tuple[Op, ...]
) -> tuple[list[tuple[Op, int, int]], int, int]:
    """Run ``ops``; after each op compare the tracked live bytes with the simulator's.

    Returns the mismatches, the simulated peak and the measured peak. A merged backward call
    (NOTE [merged backward]) runs several B ops at once: reality is ahead of the simulator
    until the merged ones are booked, so those points are not compared.
    """
    tracker = StorageTracker()
    sim = Simulator(chain)
    mismatches: list[tuple[Op, int, int]] = []

    def record(op: Op, run: executor_module._Run) -> None:
        if op[0] == "B" and not sim.loss_done:
            sim.step(("Loss",))
        sim.step(op)
        if any(j in run.merged and j not in run.backward_done for j in range(len(layers))):
            return
        param_grads = sum(g.untyped_storage().nbytes() for g in run.param_grads if g is not None)
        # the loss below allocates its scalar and that scalar's gradient: 8 bytes
        slack = 8 if sim.loss_done else 0
        live = x.nbytes + tracker.live_nbytes - param_grads - slack
        if live != sim.alive_nbytes:
            mismatches.append((op, live, sim.alive_nbytes))

    weights = torch.randn(x.shape)
    with op_recorder(record), tracker:
        (Executor(layers, ops)(x) * weights).sum().backward()
    grads = [p.grad for m in layers for p in m.parameters() if p.grad is not None]
    measured = x.nbytes + tracker.window_peak(grads)
    tracker.close()
    return mismatches, sim.peak, measured


def test_live_memory_matches_the_simulator_op_by_op() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(64, 64), nn.Dropout(0.2), nn.Tanh()]
    x = torch.randn(32, 64, requires_grad=True)
    chain = measure(layers, x, repeats=1).to_chain()
    least, top = min_memory(chain), store_all_memory(chain)
    for limit in (least, (least + top) // 2, top):
        mismatches, peak, measured = live_mismatches(layers, x, chain, solve(chain, limit).ops)
        assert not mismatches, (limit, mismatches)
        assert peak <= limit
        # + the loss scalar and its gradient (8 bytes), the gradient placeholder (4 bytes)
        assert measured <= peak + 12
        for m in layers:
            m.zero_grad()
        x.grad = None


def test_identity_views_and_in_place_safe_layers() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Linear(16, 16),
        nn.Identity(),  # returns its input: a leaf output
        nn.ReLU(),  # keeps its output
        nn.Flatten(),  # a view of its input
        nn.Linear(16, 16),
        nn.Sigmoid(),
    ]
    x = torch.randn(8, 16, requires_grad=True)
    chain = measure(layers, x, repeats=1).to_chain()
    ref = nn.Sequential(*copy.deepcopy(layers))
    x_ref = x.detach().clone().requires_grad_(True)
    ref(x_ref).pow(2).sum().backward()
    for limit in (min_memory(chain), store_all_memory(chain)):
        ops = solve(chain, limit).ops
        x.grad = None
        for m in layers:
            m.zero_grad()
        mismatches, peak, measured = live_mismatches(layers, x, chain, ops)
        assert peak <= limit and measured <= peak + 12
        # aliases are counted once per name in the model: reality can only use less
        assert all(live <= model for _, live, model in mismatches)
        x.grad = None
        for m in layers:
            m.zero_grad()
        Executor(layers, ops)(x).pow(2).sum().backward()
        assert torch.equal(x.grad, x_ref.grad)  # type: ignore[arg-type]
        params = [p for m in layers for p in m.parameters()]
        for p, q in zip(params, ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]


def test_consecutive_backwards_share_one_engine_call(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU()]
    x = torch.randn(4, 8, requires_grad=True)
    calls: list[int] = []
    real = executor_module._grad

    def counting(*args: object) -> object:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(executor_module, "_grad", counting)
    store_all = (("Fe", 0), ("Fe", 1), ("Fe", 2), ("Fe", 3), ("Loss",))
    Executor(layers, (*store_all, ("B", 3), ("B", 2), ("B", 1), ("B", 0)))(x).sum().backward()
    assert len(calls) == 1
    split = (("Fck", 0), ("Fn", 1), ("Fe", 2), ("Fe", 3), ("Loss",), ("B", 3), ("B", 2))
    grad_store_all = x.grad
    x.grad = None
    Executor(layers, (*split, ("Fe", 0), ("Fe", 1), ("B", 1), ("B", 0)))(x).sum().backward()
    assert len(calls) == 3  # layers 3+2, then 1+0
    torch.testing.assert_close(x.grad, grad_store_all)
