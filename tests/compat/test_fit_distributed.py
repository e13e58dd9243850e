"""ts.fit under DDP on gloo, two processes: the same losses and weights as plain DDP.

DDP averages each gradient across ranks after autograd accumulates it (its reducer's hooks), so
an update run at the parameter's own post-accumulate hook would use this rank's gradient alone.
Under a process group of more than one rank ts.fit keeps gradients until optimizer.step() and
explain() says why; recomputation and the optimizer state's offload still apply.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tensorscope as ts

from ._ranks import ResidualNet, run_two_ranks

STEPS = 4


def _train(fitted: bool, rank: int) -> tuple[list[float], list[list[float]], str]:
    from torch.nn.parallel import DistributedDataParallel

    model = ResidualNet(32, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fit = ts.fit(model, optimizer, budget="700KiB") if fitted else None
    ddp = DistributedDataParallel(model)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * rank + step)
        loss = ddp(torch.randn(64, 8, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    text = fit.explain() if fit is not None else ""
    if fit is not None:
        fit.remove()
    return losses, [p.detach().flatten().tolist() for p in model.parameters()], text


def _worker(rank: int, port: int, results: Any) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results.put((rank, {"plain": _train(False, rank), "fit": _train(True, rank)}))
    except BaseException as exc:  # the parent must not wait forever
        results.put((rank, repr(exc)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.serial("distributed")  # a free port, then bound (tests/conftest.py)
def test_fit_under_ddp_trains_like_plain_ddp() -> None:
    got = run_two_ranks(_worker, timeout=300)
    for rank in range(2):
        outcome = got[rank]
        assert isinstance(outcome, dict), outcome
        plain, fitted = outcome["plain"], outcome["fit"]
        assert fitted[0] == plain[0], f"rank {rank}: losses differ"
        assert fitted[1] == plain[1], f"rank {rank}: weights differ"
        assert "process group of 2 ranks" in fitted[2], fitted[2]
        assert "optimizer state in the disk tier" in fitted[2], fitted[2]
    assert got[0]["fit"][1] == got[1]["fit"][1]  # DDP keeps the ranks' weights equal
