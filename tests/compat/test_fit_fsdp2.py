"""ts.fit and ts.record under FSDP2 (``fully_shard`` per block, then the model) on gloo, two
processes (docs/api.md §11, docs/fit.md "Across processes").

One spawn runs every case on both ranks (a process start costs seconds); the parent checks what
each rank saw:
- the memory plan of an FSDP2 step has the categories ``sharded_parameter``,
  ``unsharded_parameter``, ``reduce_scatter``, and its peak is within 5% of torch's own
  ``FSDPMemTracker`` on the same step; ``what_if(reshard_after_forward=...)`` predicts each way
  from a step recorded the other way within 5%;
- ts.fit at the least budget that fits (read from the ScheduleError of a smaller one) recomputes
  blocks outside their own backward -- the chain gathers their parameters itself --, updates
  each parameter inside backward on its reduced shard's gradient and keeps the sharded
  optimizer state in the disk tier, and trains bit-identically to plain FSDP2 (losses, weights,
  optimizer state), on both ranks one schedule, the recorded step's peak (shards, gathered
  parameters and reduce-scatter buffers counted) under the rank's budget; with clipping the
  same with gradients kept;
- different budgets on the ranks are agreed to the smallest; a tensorscope error on one rank
  (a bad budget) is raised by ``ts.fit`` on every rank, the same error; a ScheduleError too;
- ``fully_shard`` after ts.fit, a process group destroyed while a fit is attached: clear errors,
  never a hang; ``fit.remove()`` on one rank: the other rank's fit follows at the next step.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tensorscope as ts

from ._ranks import ResidualNet, run_two_ranks

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available() or sys.platform != "linux", reason="needs gloo"
    ),
    pytest.mark.slow,
    pytest.mark.serial("distributed"),  # a free port, then bound (tests/conftest.py)
    pytest.mark.engine_independent,  # the ranks run in subprocesses, without scopes
]

STEPS = 4
WIDTH, BLOCKS, BATCH = 64, 6, 1024


def _sharded(reshard: bool = True) -> tuple[ResidualNet, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = ResidualNet(WIDTH, BLOCKS)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(100 * rank + step))


def _step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, clip: bool = False
) -> float:
    loss = model(x).pow(2).mean()
    loss.backward()
    if clip:  # a read of every gradient: they are kept until optimizer.step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def _weights(model: torch.nn.Module) -> list[list[float]]:
    return [p.full_tensor().detach().flatten().tolist() for p in model.parameters()]


def _error(call: Any) -> tuple[str, str]:
    try:
        call()
    except ts.TensorScopeError as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def _plan_against_tracker(rank: int) -> dict[str, Any]:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    model, optimizer = _sharded()
    x = _batch(rank, 0)
    _step(model, optimizer, x)  # the optimizer state exists from here on
    with ts.record() as rec:
        _step(model, optimizer, x)
    plan = rec.plan()
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((x,))
    with tracker:
        _step(model, optimizer, x)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    return {"plan": plan.peak_bytes, "tracker": peak, "at_peak": dict(plan.at_peak)}


def _reshard_predicted(rank: int) -> dict[str, Any]:
    """what_if(reshard_after_forward=...) from a step recorded one way against a step recorded
    the other way."""
    peaks: dict[bool, Any] = {}
    for reshard in (True, False):
        model, optimizer = _sharded(reshard)
        x = _batch(rank, 0)
        _step(model, optimizer, x)
        with ts.record() as rec:
            _step(model, optimizer, x)
        peaks[reshard] = rec.plan()
    return {
        "recorded": {r: p.peak_bytes for r, p in peaks.items()},
        "predicted": {
            r: peaks[not r].what_if(reshard_after_forward=r).peak_bytes for r in (True, False)
        },
        "changes": list(peaks[True].what_if(reshard_after_forward=False).changes),
    }


def _state(optimizer: torch.optim.Optimizer) -> list[list[float]]:
    """The optimizer's state, whole (``state_dict()`` reads back what is in the next tier)."""
    out = []
    for values in optimizer.state_dict()["state"].values():
        for key in sorted(values):
            value = values[key]
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out.append(full.detach().flatten().tolist())
    return out


def _plain(rank: int, clip: bool = False) -> dict[str, Any]:
    model, optimizer = _sharded()
    losses = [_step(model, optimizer, _batch(rank, s), clip) for s in range(STEPS)]
    return {"losses": losses, "weights": _weights(model), "state": _state(optimizer)}


def _fitted(rank: int, budget: int, clip: bool = False) -> dict[str, Any]:
    model, optimizer = _sharded()
    fit = ts.fit(model, optimizer, budget=budget)
    losses = [_step(model, optimizer, _batch(rank, s), clip) for s in range(STEPS)]
    assert fit.decision is not None and fit.plan_after is not None
    out = {
        "peak": fit.measured_peak(fit.plan_after),  # the recorded step under the decision
        "categories": sorted({life.category for life in fit.plan_after.lifetimes}),
        "losses": losses,
        "weights": _weights(model),
        "state": _state(optimizer),
        "free": fit.decision.free_gradients,
        "state_moved": fit.decision.chosen.base.state_offloaded,
        "blocks": fit.decision.blocks,
        "gathers": fit._across.regather.gathers if fit._across.regather else 0,
        "explain": fit.explain(),
        "budget": fit.budget_bytes,
    }
    fit.remove()
    return out


def _too_small(rank: int) -> dict[str, Any]:
    """Different budgets, both too small: the smaller agreed, one ScheduleError on both."""
    model, optimizer = _sharded()
    fit = ts.fit(model, optimizer, budget=[1 << 20, 2 << 20][rank])
    kind, message = _error(lambda: _step(model, optimizer, _batch(rank, 0)))
    again = _error(lambda: model(_batch(rank, 1)))  # and at the next training forward
    text = fit.explain()
    fit.remove()
    return {"kind": kind, "message": message, "again": again, "explain": text}


def _sharded_after_fit(rank: int) -> tuple[str, str]:
    from torch.distributed.fsdp import fully_shard

    model = ResidualNet(WIDTH, BLOCKS)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fit = ts.fit(model, optimizer, budget="64MiB")
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    got = _error(lambda: model(_batch(rank, 0)))
    fit.remove()
    return got


def _one_rank_removes(rank: int) -> dict[str, Any]:
    model, optimizer = _sharded()
    fit = ts.fit(model, optimizer, budget="64MiB")
    for s in range(STEPS):
        _step(model, optimizer, _batch(rank, s))
    if rank == 0:
        fit.remove()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _step(model, optimizer, _batch(rank, STEPS))  # rank 1's fit follows rank 0's
        _step(model, optimizer, _batch(rank, STEPS + 1))
    return {"removed": fit.removed, "warned": [str(w.message) for w in seen]}


def _group_destroyed(rank: int) -> tuple[str, str]:
    model, optimizer = _sharded()
    fit = ts.fit(model, optimizer, budget="64MiB")
    _step(model, optimizer, _batch(rank, 0))
    dist.destroy_process_group()
    got = _error(lambda: model(_batch(rank, 1)))
    fit.remove()
    return got


def _worker(rank: int, port: int, results: Any) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out: dict[str, Any] = {"tracker": _plan_against_tracker(rank), "plain": _plain(rank)}
        out["reshard"] = _reshard_predicted(rank)
        out["plain_clip"] = _plain(rank, clip=True)
        out["bad"] = _error(lambda: ts.fit(*_sharded(), budget=["64MiB", "12 parsecs"][rank]))
        small = out["small"] = _too_small(rank)
        least = int(re.search(r"fits is [^(]*\((\d+) bytes\)", small["message"]).group(1))  # type: ignore[union-attr]
        out["fit"] = _fitted(rank, int(least * 1.02))
        out["fit_clip"] = _fitted(rank, int(least * 1.15), clip=True)
        out["order"] = _sharded_after_fit(rank)
        out["remove"] = _one_rank_removes(rank)
        out["destroyed"] = _group_destroyed(rank)
        results.put((rank, out))
    except BaseException as exc:  # the parent must not wait forever
        results.put((rank, repr(exc)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fit_and_record_under_fsdp2() -> None:
    got = run_two_ranks(_worker, timeout=400)
    for rank in range(2):
        assert isinstance(got[rank], dict), got[rank]
    one, two = got[0], got[1]
    for out in (one, two):
        tracker = out["tracker"]
        assert abs(tracker["plan"] - tracker["tracker"]) <= 0.05 * tracker["tracker"], tracker
        at_peak = tracker["at_peak"]
        assert at_peak["sharded_parameter"] > 0 and at_peak["unsharded_parameter"] > 0, at_peak
        assert "reduce_scatter" in at_peak
    # what_if(reshard_after_forward=...): each way predicted from the other's recording, within
    # 5% of what that way recorded (gathered parameters kept to the backward cost memory)
    for out in (one, two):
        reshard = out["reshard"]
        for way in (True, False):
            recorded, predicted = reshard["recorded"][way], reshard["predicted"][way]
            assert abs(predicted - recorded) <= 0.05 * recorded, (way, reshard)
        assert reshard["recorded"][False] > reshard["recorded"][True], reshard
        assert "kept to their backward" in reshard["changes"][0], reshard["changes"]
        assert "(0 storages)" not in reshard["changes"][0], reshard["changes"]
    # a bad budget on rank 1: ts.fit raises on both ranks, the same error
    assert one["bad"][0] == two["bad"][0] == "InvalidArgumentError", (one["bad"], two["bad"])
    assert one["bad"][1] == two["bad"][1] and "raised on rank 1" in one["bad"][1]
    # budgets 1 MiB and 2 MiB: both decide under 1 MiB and raise the same ScheduleError
    for out in (one, two):
        small = out["small"]
        assert small["kind"] == "ScheduleError" and small["again"][0] == "ScheduleError"
        assert "different budgets" in small["explain"], small["explain"]
    assert one["small"]["message"] == two["small"]["message"]
    # at the least budget: one schedule, blocks recomputed outside their own backward, each
    # update inside backward on the reduced shard's gradient, the sharded state in the disk
    # tier between updates -- and the plain run's losses, weights and state, bit for bit
    assert one["fit"]["blocks"] == two["fit"]["blocks"]
    assert "recompute" in one["fit"]["blocks"]
    for rank, out in enumerate((one, two)):
        fit, plain = out["fit"], out["plain"]
        assert fit["gathers"] > 0 and fit["free"] and fit["state_moved"], fit["explain"]
        # the budget is this rank's: its shards, what FSDP2 gathers and reduce-scatters, all
        # counted in the recorded step, whose peak stays under it
        assert {"sharded_parameter", "unsharded_parameter", "reduce_scatter"} <= set(
            fit["categories"]
        ), fit["categories"]
        assert fit["peak"] <= fit["budget"], (fit["peak"], fit["budget"], fit["explain"])
        assert fit["losses"] == plain["losses"], f"rank {rank}: losses differ"
        assert fit["weights"] == plain["weights"], f"rank {rank}: weights differ"
        assert fit["state"] == plain["state"], f"rank {rank}: optimizer state differs"
        assert "rank" in fit["explain"] and "FSDP2" in fit["explain"]
        assert "parameters 0 B" not in fit["explain"]  # the rank's shards, said
        # clipping reads every gradient: kept, the step run one parameter at a time
        clipped, plain = out["fit_clip"], out["plain_clip"]
        assert not clipped["free"] and clipped["state_moved"], clipped["explain"]
        assert clipped["losses"] == plain["losses"] and clipped["weights"] == plain["weights"]
    # fully_shard after ts.fit: the order named, on both ranks
    for out in (one, two):
        assert out["order"][0] == "InvalidArgumentError" and "order" in out["order"][1]
    # rank 0 removed its fit: rank 1's follows at the next step, with a FitWarning
    assert one["remove"]["removed"] and two["remove"]["removed"]
    assert any("another rank removed its fit" in w for w in two["remove"]["warned"])
    # the process group destroyed under an attached fit: a clear error, not a hang
    for out in (one, two):
        assert out["destroyed"][0] == "InvalidArgumentError", out["destroyed"]
        assert "destroyed" in out["destroyed"][1]
