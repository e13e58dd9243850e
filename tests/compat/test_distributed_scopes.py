"""Scopes around the steps of distributed training: DDP and FSDP2 on gloo, two processes.

DDP rebuilds its gradient buckets during the second forward, inside that step's scope; the
scope used to own and empty them, and the third backward failed an internal assert of DDP's
reducer. FSDP2 keeps unsharded parameters and all-gather buffers across steps. Neither may be
owned by a scope (their code is among _sites.py's state makers). Each variant trains the same
steps with and without scopes; losses and final parameters must be equal.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tensorscope as ts

from ._ranks import run_two_ranks

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )


def _train(model: torch.nn.Module, rank: int, scoped: bool) -> tuple[list[float], list[Any]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * rank + step)
        with ts.scope() if scoped else contextlib.nullcontext():
            loss = model(torch.randn(4, 8, generator=generator)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, list(model.parameters())


def _worker(rank: int, port: int, results: Any) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        outcome: dict[str, Any] = {}
        for scoped in (False, True):
            ddp = DistributedDataParallel(_model())
            losses, params = _train(ddp, rank, scoped)
            outcome[f"ddp-{scoped}"] = (losses, [p.tolist() for p in params])
            model = _model()
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            losses, params = _train(model, rank, scoped)
            outcome[f"fsdp-{scoped}"] = (losses, [p.full_tensor().tolist() for p in params])
        results.put((rank, outcome))
    except BaseException as exc:  # the parent must not wait forever
        results.put((rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.serial("distributed")  # a free port, then bound (tests/conftest.py)
def test_ddp_and_fsdp2_train_the_same_in_scopes() -> None:
    outcomes = run_two_ranks(_worker)
    for rank, outcome in outcomes.items():
        assert isinstance(outcome, dict), f"rank {rank} failed: {outcome}"
        for kind in ("ddp", "fsdp"):
            plain_losses, plain_params = outcome[f"{kind}-False"]
            scoped_losses, scoped_params = outcome[f"{kind}-True"]
            assert scoped_losses == plain_losses, (rank, kind)
            assert scoped_params == plain_params, (rank, kind)  # bit-identical (Python floats)
    # the ranks saw different data, yet DDP and FSDP keep their parameters in sync
    assert outcomes[0]["ddp-True"][1] == outcomes[1]["ddp-True"][1]
    assert outcomes[0]["fsdp-True"][1] == outcomes[1]["fsdp-True"][1]
    assert outcomes[0]["ddp-True"][0] != outcomes[1]["ddp-True"][0]  # they saw different data
