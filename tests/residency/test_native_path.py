"""The C++ op path of the residency manager (csrc/managed.cpp, residency/native.py).

Ops whose managed operands are all resident run natively (the fast path) and are replayed into
the ledger and the recorder later; every other op runs the Python op path. The fast path must be
indistinguishable from the Python one: same results, same clock, last uses and recorded trace,
same budget. With the Python engine these tests check the reference behaviour only.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.residency import native

MiB = 1 << 20
NATIVE = native.ENGINE is not None


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )


def _inputs() -> list[torch.Tensor]:
    # A generator of its own: threads seeding the global one would interleave their draws.
    rng = torch.Generator().manual_seed(1)
    return [torch.randn(4, 64, generator=rng) for _ in range(5)]


def _run(model: nn.Module) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(x) for x in _inputs()]


def _name(role: object) -> object:
    """A managed tensor's role without its handle's id (it differs from run to run)."""
    return role[1] if isinstance(role, tuple) and len(role) == 2 else role


def _observed(clock0: int) -> tuple[int, list[object], list[tuple[object, ...]], dict[object, int]]:
    """What the op path left behind: clock, the recorder's traces, last uses by name."""
    manager = ts.residency
    manager.sync_ops()
    recorder = manager.recorder()
    trace = list(recorder._previous_signatures) + list(recorder.current.signatures)
    keys = list(recorder.previous.ops if recorder.previous is not None else [])
    keys += list(recorder.current.keys)
    names = [tuple(_name(k) for k in op) for op in keys]
    last = {_name(p.role): p.last_use - clock0 for p in manager.ledger.placements.values()}
    return manager.clock - clock0, trace, names, last


@pytest.mark.parametrize("budget", [None, 10 * MiB])
@pytest.mark.strict
def test_resident_ops_give_the_python_paths_results_and_records(budget: int | None) -> None:
    expected = _run(_model())
    observed = []
    for fast in (False, True):
        ts.residency.reset()
        ts.residency.configure(device="cpu", policy="flow", budget=budget)
        native.disable(not fast)
        try:
            model = _model()
            handle = ts.manage(model)
            clock0 = ts.residency.clock
            before = native.counters()
            got = _run(model)
            after = native.counters()
            observed.append(_observed(clock0))
            handle.remove()
        finally:
            native.disable(False)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
        if NATIVE and fast:
            assert after[0] - before[0] > 0  # the fast path ran them
            assert after[1] - before[1] == 0  # and none went to Python
    slow_run, fast_run = observed
    assert fast_run == slow_run  # clock, trace, keys and last uses alike


@pytest.mark.strict
def test_a_placement_off_the_device_sends_ops_to_python_and_the_budget_holds() -> None:
    model = _model()
    expected = _run(_model())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ts.residency.configure(device="cpu", policy="flow", budget=weights // 2)
    ts.residency.report(reset=True)
    handle = ts.manage(model)
    before = native.counters()
    got = _run(model)
    after = native.counters()
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    if NATIVE:
        assert after[1] - before[1] > 0  # weights stream: Python decides
    assert ts.residency.report().tiers["device"].peak_bytes <= weights // 2
    handle.remove()


def test_a_truncated_arena_under_a_resident_weight_raises_not_crashes() -> None:
    model = nn.Linear(256, 256)
    ts.residency.configure(device="cpu", policy="flow", budget=10 * MiB)  # weights in files
    handle = ts.manage(model)
    placement = ts.residency.placement_of(model.weight)
    assert placement is not None and placement.tier == "device"
    x = torch.randn(2, 256)
    with torch.no_grad():
        model(x)  # fast path, while the file is intact
    assert placement.region is not None
    os.ftruncate(placement.region.file.fd, 0)  # someone else truncated the file
    with pytest.raises(ts.ResidencyError, match="truncated"), torch.no_grad():
        model(x)
    with pytest.warns(ts.ResidencyWarning):
        ts.residency.reset()
    del handle


@pytest.mark.strict
def test_scopes_and_optimizer_steps_take_the_python_path() -> None:
    model = _model()
    ts.residency.configure(device="cpu", policy="flow", budget=None)
    handle = ts.manage(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ts.scope():
        before = native.counters()
        loss = model(_inputs()[0]).square().mean()
        after = native.counters()
        loss.backward()
        opt.step()
    if NATIVE:
        assert after[0] == before[0]  # results are managed in a scope: Python registers them
    for p in model.parameters():
        assert p.grad is not None and ts.residency.placement_of(p.grad) is not None
    handle.remove()


@pytest.mark.strict
def test_two_threads_with_resident_models_stay_exact() -> None:
    models = [_model(), _model()]
    expected = _run(_model())
    ts.residency.configure(device="cpu", policy="flow", budget=4 * MiB)
    ts.residency.report(reset=True)
    results: list[list[torch.Tensor]] = [[], []]
    handles = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        handles.append(ts.manage(models[i]))  # on this thread
        start.wait(timeout=60)
        for _ in range(20):
            results[i] = _run(models[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert ts.residency.report().tiers["device"].peak_bytes <= 4 * MiB
    for handle in handles:
        handle.remove()


@torch.jit.script
def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


@torch.jit.script
def _forked_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.jit.wait(torch.jit.fork(_matmul, x, w))


@pytest.mark.strict
def test_a_thread_that_inherits_the_key_goes_through_the_manager() -> None:
    """torch hands a thread's dispatch keys to the threads that work for it: autograd's device
    threads (a CUDA backward), TorchScript's fork (here, on the CPU). Such a thread never
    attached, yet its ops on managed tensors must take the op path (a demoted CUDA storage
    read plain would be freed memory): as the Python engine's inherited mode does."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256, bias=False)
    ts.residency.configure(policy="genoa", budget=300_000)
    x = torch.randn(4, 256)
    expected = x @ model.weight.detach().clone()
    with ts.manage(model):
        w = model.weight
        for _ in range(2):
            w.demote()  # type: ignore[attr-defined]
            before = ts.residency.report().transfers.count
            out = _forked_matmul(x, w)
            assert ts.residency.report().transfers.count - before == 2  # promoted, demoted
            assert torch.equal(out, expected)
