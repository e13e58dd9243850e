"""``ts.record()`` on a plain MLP: exact bytes, the allocator's view, nothing left behind."""

from __future__ import annotations

import dataclasses
import pickle
import threading
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.plan.data import categories_of

from ._support import allocator_peak, mlp, mlp_step, state_tensors, storage_bytes

pytestmark = pytest.mark.engine_independent  # recordings of plain steps (checked)


def _record(step: Any, **kwargs: Any) -> ts.MemoryPlan:
    with ts.record(**kwargs) as rec:
        step()
    return rec.plan()


def test_parameters_gradients_and_optimizer_state_at_the_peak_are_exact() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    step = mlp_step(model, opt)
    step()  # the optimizer's state exists from now on
    plan = _record(step)
    params = storage_bytes(model.parameters())
    assert plan.at_peak["parameter"] == params
    assert plan.at_peak["optimizer_state"] == storage_bytes(state_tensors(opt))
    assert plan.peak_phase == "optimizer"  # Adam's temporaries on top of all gradients
    assert plan.at_peak["gradient"] == params
    assert sum(plan.at_peak.values()) == plan.peak_bytes
    names = {life.name for life in plan.lifetimes if life.category == "parameter"}
    assert names == {n for n, _ in model.named_parameters()}
    assert all(
        plan.lifetimes[life.owner].name == life.name
        for life in plan.lifetimes
        if life.category in ("gradient", "optimizer_state")
    )


def test_the_first_step_creates_the_optimizer_state() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    plan = _record(mlp_step(model, opt))
    states = [life for life in plan.lifetimes if life.category == "optimizer_state"]
    assert states and all(life.created >= 0 for life in states)
    assert plan.optimizer_steps and plan.optimizer_steps[0][0] <= min(s.created for s in states)


def test_peak_matches_the_allocator() -> None:
    model = mlp(width=512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = mlp_step(model, opt)
    step()
    plan = _record(step)
    existing = sum(life.nbytes for life in plan.lifetimes if life.created < 0)
    measured = allocator_peak(step)
    assert 0.98 <= (plan.peak_bytes - existing) / measured <= 1.02


def test_timeline_and_lifetimes() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = _record(mlp_step(model, opt))
    assert len(plan.timeline) == len(plan.ops)
    for op, seconds, row in plan.timeline:
        assert set(row) == set(categories_of(()))
        assert seconds == plan.ops[op].seconds
    assert sum(plan.timeline[plan.peak_op][2].values()) == plan.peak_bytes
    assert max(sum(row.values()) for _, _, row in plan.timeline) == plan.peak_bytes
    for life in plan.lifetimes:
        assert life.freed is None or life.freed > max(life.created, 0)
        assert life.last_use < len(plan.ops)
    assert {op.phase for op in plan.ops} == {"forward", "backward", "optimizer"}
    assert [c.path for c in plan.calls[:2]] == ["", "0"]
    assert all(c.backward is not None for c in plan.calls if c.path in ("0", "2", "4"))


def test_a_view_counts_once_and_the_peak_names_the_line() -> None:
    def step() -> None:
        big = torch.zeros(1 << 18)
        halves = big.view(2, -1).unbind(0)
        total = halves[0] + halves[1]  # PEAK LINE: big (1 MiB) and total (0.5 MiB)
        del big, halves
        total.sum().item()

    plan = _record(step)
    line = next(n for n, text in enumerate(_source(step), 1) if "PEAK LINE" in text)
    assert plan.peak_bytes == (1 << 20) + (1 << 19)
    assert plan.peak_site.endswith(f":{line} in step")
    assert plan.at_peak["temporary"] == plan.peak_bytes


def _source(function: Any) -> list[str]:
    import inspect

    lines, first = inspect.getsourcelines(function)
    return [""] * (first - 1) + lines


def test_the_plan_holds_no_torch_state() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = _record(mlp_step(model, opt))
    seen: list[object] = []

    def walk(value: object) -> None:
        assert not isinstance(value, (torch.Tensor, torch.UntypedStorage, nn.Module))
        assert type(value).__module__.split(".")[0] != "torch", type(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        seen.append(value)

    walk(plan)
    assert pickle.loads(pickle.dumps(plan)).peak_bytes == plan.peak_bytes
    assert "peak" in str(plan) and "largest tensors alive at the peak" in str(plan)


def _global_state() -> tuple[int, ...]:
    from torch.nn.modules import module as module_hooks
    from torch.optim import optimizer as optimizer_hooks

    return (
        len(module_hooks._global_forward_pre_hooks),
        len(module_hooks._global_forward_hooks),
        len(optimizer_hooks._global_optimizer_pre_hooks),
        len(optimizer_hooks._global_optimizer_post_hooks),
        torch._C._len_torch_dispatch_stack(),
        int(torch._C._autograd._top_saved_tensors_default_hooks(False) is not None),
    )


def test_nothing_of_the_model_or_optimizer_changes_and_nothing_stays_installed() -> None:
    before = _global_state()
    plain, recorded = mlp(), mlp()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=0.01)
    opt_recorded = torch.optim.AdamW(recorded.parameters(), lr=0.01)
    step_plain, step_recorded = mlp_step(plain, opt_plain), mlp_step(recorded, opt_recorded)
    for _ in range(3):
        step_plain()
        with ts.record():
            step_recorded()
    assert _global_state() == before
    for a, b in zip(plain.parameters(), recorded.parameters(), strict=True):
        assert torch.equal(a, b) and type(b) is nn.Parameter
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in recorded.modules())
    assert not opt_recorded._optimizer_step_pre_hooks
    state_a, state_b = opt_plain.state_dict(), opt_recorded.state_dict()
    for key in state_a["state"]:
        for name, value in state_a["state"][key].items():
            assert torch.equal(value, state_b["state"][key][name])


def test_an_exception_in_the_block_still_removes_everything() -> None:
    before = _global_state()
    model = mlp()
    rec = ts.record()
    try:
        with rec:
            model(torch.randn(4, 64)).sum()
            raise KeyError("user error")
    except KeyError:
        pass
    assert _global_state() == before
    plan = rec.plan()  # what ran before the error
    assert plan.ops and plan.at_peak["parameter"] == storage_bytes(model.parameters())


def test_threads_record_their_own_ops() -> None:
    plans: dict[str, ts.MemoryPlan] = {}
    start = threading.Barrier(2)

    def work(name: str, size: int) -> None:
        start.wait()
        with ts.record() as rec:
            for _ in range(20):
                torch.ones(size).mul(2).sum()
        plans[name] = rec.plan()

    threads = [threading.Thread(target=work, args=(n, s)) for n, s in (("a", 1000), ("b", 64))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert plans["a"].peak_bytes == 2 * 4000 and plans["b"].peak_bytes == 2 * 256  # ones, mul
    assert len(plans["a"].ops) == len(plans["b"].ops) == 60


def test_saved_tensor_hooks_can_be_left_out_for_torch_func() -> None:
    model = mlp()
    x = torch.randn(8, 64)
    params = dict(model.named_parameters())

    def loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).square().mean()

    with ts.record(saved_tensors=False) as rec:
        grads = torch.func.grad(loss)(params)
    plan = rec.plan()
    assert set(grads) == set(params) and plan.peak_bytes > 0
    assert plan.at_peak["parameter"] == storage_bytes(model.parameters())


def test_dataloader_workers_forked_while_recording() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 8))
    model = nn.Linear(8, 2)
    with ts.record() as rec:
        for (x,) in DataLoader(data, batch_size=16, num_workers=2):
            model(x).sum().backward()
    plan = rec.plan()
    assert plan.at_peak["parameter"] == 8 * 2 * 4 + 2 * 4
    gradients = [life for life in plan.lifetimes if life.category == "gradient"]
    assert sum(life.nbytes for life in gradients) == plan.at_peak["parameter"]  # made once
    assert len([op for op in plan.ops if op.phase == "backward"]) > 4  # four backwards


def test_another_threads_backward_is_not_recorded() -> None:
    # thread B runs a backward whose hooks step its optimizer (optimizer-in-backward) while
    # thread A records: B's parameters and optimizer state are not A's step
    import threading

    a = torch.nn.Linear(8, 8)
    b = torch.nn.Linear(256, 256)
    opt_b = torch.optim.AdamW(b.parameters())

    def update(p: torch.Tensor) -> None:
        opt_b.step()
        opt_b.zero_grad()

    for p in b.parameters():
        p.register_post_accumulate_grad_hook(update)
    recording, done = threading.Event(), threading.Event()

    def other() -> None:
        recording.wait(30)
        b(torch.ones(4, 256)).sum().backward()
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with ts.record() as rec:
        a(torch.ones(2, 8)).sum().backward()
        recording.set()
        assert done.wait(30)
    thread.join(30)
    plan = rec.plan()
    b_bytes = sum(p.nbytes for p in b.parameters())
    assert plan.peak_bytes < b_bytes  # A's whole step is smaller than B's weight alone
    assert plan.at_peak["optimizer_state"] == 0


def test_a_resized_storage_is_one_lifetime_per_size() -> None:
    """FSDP2 frees a gathered parameter with ``storage.resize_(0)`` and gathers into the same
    storage again (NOTE [resized storages]): each size is a lifetime, and the timeline follows."""
    gathered = torch.empty(64 * 1024)  # 256 KiB, alive before the step
    other = torch.ones(1024)
    storage = gathered.untyped_storage()
    nbytes = storage.nbytes()
    original = torch.UntypedStorage.resize_
    with ts.record() as rec:
        a = other * 2  # op 0: the gathered bytes are alive
        storage.resize_(0)  # freed before op 1
        b = a + 1  # op 1
        storage.resize_(nbytes)  # gathered again before op 2
        gathered.fill_(3.0)  # op 2
        c = b * 2  # op 3
    del a, b, c
    plan = rec.plan()
    lives = [life for life in plan.lifetimes if life.nbytes == nbytes]
    assert [(life.created, life.freed) for life in lives] == [(-1, 1), (2, None)]
    totals = [sum(row[2].values()) for row in plan.timeline]
    assert totals[1] + nbytes == totals[2] and totals[0] - totals[1] == nbytes - 4096
    assert torch.UntypedStorage.resize_ is original  # the wrapper is gone at the close
