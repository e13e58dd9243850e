"""Check 3: residency moves on the device's real streams give the bytes back unchanged, and
device memory goes back to the allocator when a tensor leaves the device.

- Managed parameters (odd sizes included) demoted to each tier and each path down (device ->
  host -> disk on CUDA; device -> disk on the CPU) and promoted again: values equal, and
  ``memory_allocated`` (synchronised) falls by exactly their blocks and comes back to its
  baseline.
- Prefetches on the copy stream while the compute stream is busy (queued matmuls), an op
  right after them, and a demotion while that op's kernels may still be queued: outputs equal
  the plain module's (a prefetch's event waited on; freed memory not reused under a kernel
  that reads it).
- fit's activation store (pinned host memory and a side stream on CUDA, the disk tier on the
  CPU): a tensor still being computed when its copy is queued comes back equal.
- Training a managed MLP under a budget of 5/12 of its weights, in scopes: the backward
  moves weights too (on CUDA it runs on autograd's device thread, which inherits the op path:
  csrc/managed.cpp's NOTE [threads that inherit the key]); losses and weights equal plain's.

Layer: the check package.
"""

from __future__ import annotations

import torch
from torch import nn

import tensorscope as ts
from tensorscope.check.context import Context
from tensorscope.check.measure import allocator, sync, warm_up
from tensorscope.fit.offload_store import make_store
from tensorscope.residency.placement import Placement

__all__ = ["run"]


def _rounded(nbytes: int) -> int:
    """The caching allocator's block for a request of ``nbytes`` (multiples of 512 B)."""
    return max(512, (nbytes + 511) // 512 * 512)


def _model(ctx: Context) -> nn.Module:
    width = 256 if ctx.small else 2048
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3), nn.ReLU(), nn.Linear(3, width)
    ).to(ctx.device)


def run(ctx: Context) -> None:
    device = ctx.device
    warm_up(device)
    model = _model(ctx)
    x = torch.randn(64, next(model.parameters()).shape[1], device=device)
    with torch.no_grad():
        expected_out = model(x).cpu()
    expected = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    ts.residency.configure(device=str(device), policy="flow", budget=None)
    handle = ts.manage(model)
    try:
        _round_trips(ctx, model, expected)
        _streams(ctx, model, x, expected_out)
    finally:
        handle.remove()
        ts.residency.reset()
    _store(ctx)
    _training(ctx)


def _training(ctx: Context) -> None:
    device = ctx.device
    width = 128 if ctx.small else 1024
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(12)]).to(device)
    plain = nn.Sequential(*[nn.Linear(width, width) for _ in range(12)]).to(device)
    plain.load_state_dict(model.state_dict())
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
    budget = 5 * width * width * 4  # AdamW's update of one weight needs about four at once
    x = torch.randn(32, width, device=device)
    ts.residency.configure(device=str(device), policy="flow", budget=budget)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    losses, plain_losses = [], []
    handle = ts.manage(model)
    try:
        for _ in range(3):
            with ts.scope():
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            plain_loss = plain(x).square().mean()
            plain_loss.backward()
            plain_opt.step()
            plain_opt.zero_grad()
            plain_losses.append(plain_loss.item())
        report = ts.residency.report()
    finally:
        handle.remove()
        ts.residency.reset()
    ctx.note("training under 5/12 of the weights: transfers", report.transfers.count)
    ctx.note(
        "pinned host memory for copies now; copies through pageable memory instead (why)",
        [report.pinned_bytes, report.pageable_copies, report.pageable_reason],
    )
    ctx.expect("training under 5/12 of the weights: losses equal plain's",
               losses == plain_losses, losses, plain_losses)  # fmt: skip
    wrong = [n for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True)
             if not torch.equal(p.detach().cpu(), q.detach().cpu())]  # fmt: skip
    ctx.expect("training under 5/12 of the weights: weights equal plain's after 3 steps",
               not wrong, wrong or "all equal", "all equal")  # fmt: skip
    ctx.note("training under 5/12 of the weights: weights, budget", [weights, budget])
    ctx.expect("training under 5/12 of the weights: the manager's device peak <= budget",
               report.peak_bytes <= budget, report.peak_bytes, f"<= {budget}")  # fmt: skip


def _same(model: nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    sync(next(model.parameters()).device)
    return [
        name for name, p in model.named_parameters() if not torch.equal(p.cpu(), expected[name])
    ]


def _round_trips(ctx: Context, model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    params = list(model.parameters())
    blocks = sum(_rounded(p.untyped_storage().nbytes()) for p in params)
    paths = [("host",), ("disk",), ("host", "disk")] if ctx.cuda else [("disk",)]
    base = allocator(ctx.device).get("allocated")
    for path in paths:
        for p in params:
            for tier in path:
                p.demote(tier)  # type: ignore[attr-defined]
        tiers = sorted({p.tier for p in params})  # type: ignore[attr-defined]
        name = " -> ".join(("device", *path))
        ctx.expect(f"{name}: every parameter on {path[-1]}", tiers == [path[-1]], tiers, [path[-1]])
        if base is not None:
            down = allocator(ctx.device)["allocated"]
            ctx.expect(
                f"{name}: memory_allocated fell by the parameters' blocks",
                base - down == blocks,
                base - down,
                blocks,
            )
        for p in params:
            p.promote()  # type: ignore[attr-defined]
        wrong = _same(model, expected)
        ctx.expect(f"{name} -> device: values equal", not wrong, wrong or "all equal", "all equal")
        if base is not None:
            back = allocator(ctx.device)["allocated"]
            ctx.expect(
                f"{name} -> device: memory_allocated back to its baseline",
                back == base,
                back - base,
                0,
            )


def _placements(model: nn.Module) -> list[Placement]:
    found = [ts.residency.placement_of(p) for p in model.parameters()]
    return [p for p in found if p is not None]


def _busy(device: torch.device) -> torch.Tensor:
    """Queue enough work on the compute stream that a copy stream not waiting for it would be
    caught racing (on the CPU it simply runs)."""
    n = 64 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device)
    for _ in range(1 if device.type == "cpu" else 8):
        a = a @ a / n
    return a


def _streams(ctx: Context, model: nn.Module, x: torch.Tensor, expected: torch.Tensor) -> None:
    device = ctx.device
    manager = ts.residency
    for p in model.parameters():
        p.demote()  # type: ignore[attr-defined]
    rounds = 3
    outs = []
    for _ in range(rounds):
        _busy(device)
        for placement in _placements(model):
            manager.prefetch(placement)  # CUDA: the copy stream; CPU: the prefetch threads
        with torch.no_grad():
            outs.append(model(x))  # waits for each prefetch's event, not for the host
        for p in model.parameters():  # at once: the op's kernels may still be queued
            p.demote()  # type: ignore[attr-defined]
        _busy(device)  # new allocations that must not land on memory a queued kernel reads
    sync(device)
    wrong = [i for i, out in enumerate(outs) if not torch.equal(out.cpu(), expected)]
    ctx.expect(
        "prefetch on the copy stream, op, demotion at once: outputs equal plain",
        not wrong,
        f"rounds {wrong} differ" if wrong else f"{rounds} rounds equal",
        "all equal",
    )
    ctx.note("prefetches", manager.report().prefetches)
    for p in model.parameters():
        p.promote()  # type: ignore[attr-defined]


def _store(ctx: Context) -> None:
    device = ctx.device
    store = make_store(device, None, reuse_files=False)
    try:
        results = []
        for _ in range(3):
            t = _busy(device) * 1.5  # still being computed when its copy is queued
            storage = t.untyped_storage()
            copy = store.finish(storage, store.begin(storage))
            expected = t.to("cpu", copy=True)
            t.fill_(float("nan"))  # the copy must not see later writes
            back = store.ready(store.read(copy, storage.nbytes()))
            again = torch.empty(0, dtype=t.dtype, device=device).set_(back, 0, t.shape, t.stride())
            results.append(torch.equal(again.cpu(), expected))
            store.release(copy)
        ctx.expect(
            f"fit's activation store ({store.tier}): round trips of tensors in flight equal",
            all(results),
            results,
            "all True",
        )
    finally:
        store.close()
