"""Checkpointable end to end: training equals plain training, memory stays under the limit."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from tensorscope.checkpoint import Checkpointable, min_memory, store_all_memory
from tensorscope.checkpoint.module import LOSS_SCALAR_NBYTES, RNG_STATE_NBYTES
from tensorscope.checkpoint.tracker import StorageTracker
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError, ScheduleError

pytestmark = pytest.mark.engine_independent  # rotor runs plain torch ops (checked)

WIDTH = 48


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = [
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Dropout(0.2), nn.GELU())
        for _ in range(4)
    ]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, 1))


def bounds(model: Checkpointable) -> tuple[int, int]:
    chain = model.chain()
    return (
        min_memory(chain) + model.reserved_nbytes,
        store_all_memory(chain) + model.reserved_nbytes,
    )


def test_bad_arguments() -> None:
    with pytest.raises(ArgumentTypeError, match=r"nn\.Sequential"):
        Checkpointable(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="cannot parse mem_limit"):
        Checkpointable(make_net(), mem_limit="12 parsecs")
    with pytest.raises(InvalidArgumentError):
        Checkpointable(make_net(), mem_limit=-5)
    with pytest.raises(InvalidArgumentError, match="no layer"):
        Checkpointable(nn.Sequential())


def test_limit_too_small_says_what_fits() -> None:
    model = Checkpointable(make_net(), mem_limit=1000, repeats=1)
    with pytest.raises(ScheduleError) as err:
        model(torch.randn(32, WIDTH))
    msg = str(err.value)
    assert msg.startswith("tensorscope.checkpoint: no schedule fits mem_limit=1000 B")
    found = re.search(r"smallest limit that fits is [0-9.]+ [KMG]?i?B \(([0-9]+) bytes\)", msg)
    assert found is not None, msg
    least = int(found.group(1))
    assert least == bounds(model)[0]
    assert "Raise mem_limit to at least" in msg
    model.compute_sequence(least)  # exactly the suggested limit works
    model(torch.randn(32, WIDTH)).sum().backward()


def test_training_equals_plain_training() -> None:
    plain = make_net()
    model = Checkpointable(copy.deepcopy(plain), repeats=1)
    x = torch.randn(32, WIDTH)
    model.measure(x)
    least, top = bounds(model)
    model.compute_sequence(least + (top - least) // 4)
    assert model.schedule is not None and len(model.schedule.ops) > 2 * len(model.layers) + 1
    opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        batch = torch.randn(32, WIDTH)
        for net, optim in ((plain, opt_ref), (model, opt)):
            torch.manual_seed(100 + i)
            optim.zero_grad()
            net(batch).pow(2).mean().backward()
            optim.step()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    for b, c in zip(plain.buffers(), model.buffers(), strict=True):
        assert torch.equal(b, c)
    assert list(model.state_dict()) == [f"model.{k}" for k in plain.state_dict()]


def test_eval_and_no_grad_run_the_plain_model() -> None:
    model = Checkpointable(make_net(), mem_limit="1MiB")
    x = torch.randn(8, WIDTH)
    model.eval()
    assert torch.equal(model(x), model.model(x))
    model.train()
    with torch.no_grad():
        model(x)
    assert model.profile is None  # nothing was measured or checkpointed
    assert "not measured yet" in model.explain()


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_measured_peak_stays_under_the_limit(fraction: float) -> None:
    model = Checkpointable(make_net(), loss_tmp_nbytes=64, repeats=1)
    x = torch.randn(64, WIDTH)
    model.measure(x)
    least, top = bounds(model)
    limit = least + int(fraction * (top - least))
    schedule = model.compute_sequence(limit)
    assert schedule is not None
    params = list(model.parameters())
    with StorageTracker() as tracker:
        model(x).sum().backward()
    peak = x.nbytes + tracker.window_peak([p.grad for p in params if p.grad is not None])
    tracker.close()
    # RNG states (reserved) are not tensors the tracker sees; the loss is within loss_tmp_nbytes
    assert peak <= schedule.peak + LOSS_SCALAR_NBYTES <= limit
    plain_peak = store_all_memory(model.chain())
    assert peak < plain_peak
    assert model.reserved_nbytes == LOSS_SCALAR_NBYTES + RNG_STATE_NBYTES * 4  # 4 Dropouts


def test_explain_and_compute_sequence() -> None:
    model = Checkpointable(make_net(), mem_limit="10GiB", repeats=1)
    x = torch.randn(32, WIDTH)
    model(x).sum().backward()
    text = model.explain()
    assert "at or above what storing everything needs" in text
    assert "+0.0% time" in text
    assert text.count("kept with autograd") == len(model.layers)
    least, _ = bounds(model)
    schedule = model.compute_sequence(least)
    assert schedule is not None and model.mem_limit == least
    text = model.explain()
    assert "slots of" in text and "recomputed" in text and "input checkpointed" in text
    assert len(text.splitlines()) == 5 + len(model.layers)
    model(x).sum().backward()


def test_default_cpu_limit_stores_everything_and_measures_once() -> None:
    model = Checkpointable(make_net(), repeats=1)
    model(torch.randn(32, WIDTH)).sum().backward()
    assert model.schedule is not None
    assert all(op[0] in ("Fe", "B", "Loss") for op in model.schedule.ops)
    assert "every activation stored" in model.explain()
    first = model.profile
    model(torch.randn(16, WIDTH)).sum().backward()  # smaller batch: same schedule
    assert model.profile is first
    model(torch.randn(64, WIDTH)).sum().backward()  # larger batch: measured again
    assert model.profile is not first and model.profile is not None
    assert model.profile.input_nbytes == 64 * WIDTH * 4


def test_nested_sequentials_and_in_place_layers() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)),
        nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 2))),
    )
    plain = copy.deepcopy(net)
    model = Checkpointable(net, repeats=1)
    assert len(model.layers) == 5
    x = torch.randn(4, 8)
    model.measure(x)
    assert len(model.layers) == 4  # the in-place ReLU is fused with the Linear before it
    model.compute_sequence(bounds(model)[0])
    model(x).sum().backward()
    plain(x).sum().backward()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="in place"):
        Checkpointable(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8))).measure(x)
