"""``ts.manage()`` with DistributedDataParallel and FSDP2 on gloo, two processes (issue 15).

Either order works with DDP: ``DDP(model)`` then ``ts.manage(ddp)``, and ``ts.manage(model)``
then ``DDP(model)`` (DDP's construction broadcasts every parameter with one ``torch.cat`` of all
of them, which the manager now runs in pieces that fit the budget). Training under a budget
below the model's size ends with the parameters of the same run without tensorscope, equal on
both ranks, the peak within the budget. FSDP2 (``fully_shard``) makes ``DTensor`` parameters,
which cannot be managed: either order raises a ``ResidencyError`` that says so.

Both processes run every case in one spawn (a process start costs seconds). Scopes around
DDP steps are the scope engine's part (DDP's gradient buckets must never be owned by a scope)
and are covered with its tests.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tensorscope as ts

from ._ranks import free_port

# ~20 s here: two processes import torch, and DDP's constructor imports torch._dynamo (~4 s).
pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available() or sys.platform != "linux", reason="needs gloo"
    ),
    pytest.mark.slow,
    pytest.mark.serial("distributed"),  # a free port, then bound (tests/conftest.py)
]

BUDGET = 40 * 1024  # parameters 35 KiB, with gradients 70 KiB: the budget binds
WORLD = 2


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # each rank starts from other weights: DDP broadcasts rank 0's
    return nn.Sequential(
        nn.Linear(64, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, 8),
    )


def _train(wrapped: nn.Module, rank: int) -> list[float]:
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = []
    for _ in range(3):
        x = torch.randn(4, 64, generator=generator)
        loss = wrapped(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _flat(model: nn.Module) -> torch.Tensor:
    """The parameters (DDP keeps them equal on every rank; BatchNorm's running statistics are
    each rank's own since the last forward)."""
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _ddp_case(order: str, rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ts.residency.configure(device="cpu", policy="flow", budget=BUDGET)
    ts.residency.report(reset=True)
    model = _model(seed=rank)
    if order == "plain":
        wrapped: nn.Module = DDP(model)
        handle = None
    elif order == "ddp_first":
        wrapped = DDP(model)
        handle = ts.manage(wrapped)
    else:
        handle = ts.manage(model)
        wrapped = DDP(model)  # its broadcast of every parameter runs under the budget
    losses = _train(wrapped, rank)
    report = ts.residency.report()
    managed = [ts.residency.placement_of(t) is not None for t in model.parameters()]
    grads = [ts.residency.placement_of(t.grad) is not None for t in model.parameters()]
    state = _flat(model)
    gathered = [torch.zeros_like(state) for _ in range(WORLD)]
    torch.distributed.all_gather(gathered, state)
    if handle is not None:
        handle.remove()
    result = {
        "losses": losses,
        "state": state.tolist(),
        "replicas_equal": torch.equal(gathered[0], gathered[1]),
        "peak": report.peak_bytes,
        "moves": report.transfers.count,
        "managed": managed,
        "grads_managed": grads,
        "plain_after_remove": all(type(p) is nn.Parameter for p in model.parameters()),
    }
    ts.residency.reset()
    return result


def _fsdp_case(order: str, rank: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    ts.residency.configure(device="cpu", policy="flow", budget=BUDGET)
    model = _model(seed=0)
    try:
        if order == "shard_then_manage":
            fully_shard(model, mesh=mesh)
            ts.manage(model)
        else:
            handle = ts.manage(model)
            fully_shard(model, mesh=mesh)
            _train(model, rank)  # the first optimizer step finds the DTensors
            handle.remove()
    except ts.ResidencyError as error:
        return str(error)
    finally:
        ts.residency.reset()
    return "no error"


def _worker(rank: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        results: dict[str, Any] = {
            order: _ddp_case(order, rank) for order in ("plain", "ddp_first", "manage_first")
        }
        for order in ("shard_then_manage", "manage_then_shard"):
            results[order] = _fsdp_case(order, rank)
    finally:
        torch.distributed.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    init = f"tcp://127.0.0.1:{free_port()}"
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        torch.multiprocessing.spawn(_worker, args=(init, str(out)), nprocs=WORLD, join=True)
    finally:
        if env is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = env
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("order", ["ddp_first", "manage_first"])
def test_ddp_and_manage_in_either_order_train_like_plain_ddp(
    order: str, results: list[dict[str, Any]]
) -> None:
    for rank in range(WORLD):
        plain, ours = results[rank]["plain"], results[rank][order]
        assert ours["losses"] == plain["losses"], rank
        assert ours["state"] == plain["state"], rank
        assert ours["replicas_equal"] and plain["replicas_equal"]
        assert all(ours["managed"]) and all(ours["grads_managed"]), rank
        assert ours["peak"] <= BUDGET and ours["moves"] > 0, rank  # the budget did bind
        assert ours["plain_after_remove"], rank


@pytest.mark.parametrize("order", ["shard_then_manage", "manage_then_shard"])
def test_fsdp2_and_manage_raise_a_clear_error(order: str, results: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        message = results[rank][order]
        assert message.startswith("tensorscope.residency:"), message
        assert "DTensor" in message and "FSDP2" in message, message
