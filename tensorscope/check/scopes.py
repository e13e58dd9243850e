"""Check 1: a scope gives back every byte it owned, and a disposed tensor raises when used.

On CUDA the measure is the caching allocator's ``memory_allocated``: after a warm-up (NOTE
[cuBLAS workspaces] in measure.py) it must come back exactly to its baseline when a scope
closes, stray references to the scope's tensors notwithstanding. Where it does not, the
workspaces are given back on both sides and compared again, so that a difference they make is
named. On the CPU (no allocator counters) the measure is the storages: a weak reference to each
scope-made storage must be dead once the scope closed.

Layer: the check package.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import tensorscope as ts
from tensorscope.check.context import Context
from tensorscope.check.measure import allocator, sync, warm_up, workspace_bytes

__all__ = ["run"]


def _body(ctx: Context, leaked: list[Any], storages: list[Any]) -> None:
    """What runs inside the scope: factories, matmuls, a backward, views; references to some
    results escape into ``leaked`` (the classic leak a scope must survive)."""
    n = 256 if ctx.small else 2048
    x = torch.randn(n, n, device=ctx.device)
    w = torch.randn(n, n, device=ctx.device, requires_grad=True)
    h = torch.tanh(x @ w)
    loss = h.square().mean()
    torch.autograd.backward(loss)
    view = h[: n // 2]
    grad = w.grad
    assert grad is not None
    # Stray references to refs the scope owns; not to w.grad: a .grad is never owned, it is let
    # go when its leaf is disposed (docs/scopes.md), and a reference to it would keep it.
    leaked += [h, view, loss]
    for name, t in (("x", x), ("w", w), ("h", h), ("loss", loss), ("w.grad", grad)):
        storages.append((name, weakref.ref(t.untyped_storage())))


def run(ctx: Context) -> None:
    device = ctx.device
    warm_up(device)
    if ctx.cuda:
        before_ws = workspace_bytes(device)
        base_no_ws = allocator(device)["allocated"]
        warm_up(device)  # the workspaces again, so that the scope does not make them
        base = allocator(device)["allocated"]
        blocks_before = _active_blocks()
        ctx.note("cublas_workspaces_at_baseline_bytes", before_ws)
        ctx.note("allocated_baseline_bytes", base)
    leaked: list[Any] = []
    storages: list[Any] = []
    with ts.scope():
        _body(ctx, leaked, storages)
    sync(device)
    alive = {name: ref() for name, ref in storages}
    held = {name: s.nbytes() for name, s in alive.items() if s is not None and s.nbytes()}
    ctx.expect(
        "bytes of scope-made storages (x, w, h, loss, w.grad) alive after close",
        not held,
        held or 0,
        0,
    )
    if ctx.cuda:
        after = allocator(device)["allocated"]
        ctx.note("allocated_after_scope_bytes", after)
        if after == base:
            ctx.expect("memory_allocated back to its baseline", True, after - base, "0 B above")
        else:
            new = {a: s for a, s in _active_blocks().items() if blocks_before.get(a) != s}
            ctx.note("blocks allocated after the scope that were not at the baseline (sizes)",
                     sorted(new.values(), reverse=True)[:16])  # fmt: skip
            ws = workspace_bytes(device)
            after_no_ws = allocator(device)["allocated"]
            ctx.note("cublas_workspaces_after_scope_bytes", ws)
            ctx.note("allocated_after_scope_without_workspaces_bytes", after_no_ws)
            ctx.expect(
                "memory_allocated back to its baseline (cuBLAS workspaces given back on both "
                "sides)",
                after_no_ws == base_no_ws,
                f"{after - base} B above; {after_no_ws - base_no_ws} B without workspaces",
                "0 B above",
            )
    _use_after_dispose(ctx, leaked)
    _training_steps(ctx)


def _use_after_dispose(ctx: Context, leaked: list[Any]) -> None:
    h, view, loss = leaked[0], leaked[1], leaked[2]
    tries: dict[str, Callable[[], Any]] = {
        "h + 1": lambda: h + 1,
        "view.sum()": lambda: view.sum(),
        "torch.matmul(h, h)": lambda: torch.matmul(h, h),
        "loss.item()": lambda: loss.item(),
    }
    for what, attempt in tries.items():
        try:
            attempt()
        except ts.DisposedTensorError:
            outcome = "DisposedTensorError"
        except Exception as exc:  # any other outcome is the finding
            outcome = f"{type(exc).__name__}: {exc}"[:200]
        else:
            outcome = "no error"
        ctx.expect(
            f"use after dispose: {what}",
            outcome == "DisposedTensorError",
            outcome,
            "DisposedTensorError",
        )


def _training_steps(ctx: Context) -> None:
    """A training loop with a scope around each step: from the second step on (the optimizer's
    state exists), memory after each step is exactly what it was after the first."""
    device = ctx.device
    width = 64 if ctx.small else 1024
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, width, device=device)
    losses = []
    after: list[int] = []
    for _ in range(4):
        with ts.scope():
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)  # a stray reference, disposed at exit all the same
        sync(device)
        after.append(allocator(device)["allocated"] if ctx.cuda else ts.stats().live)
    ctx.note("allocated_after_each_step" if ctx.cuda else "live_refs_after_each_step", after)
    ctx.expect(
        "training steps in scopes: "
        + ("memory_allocated" if ctx.cuda else "live refs")
        + " after steps 2-4 equals step 1's",
        len(set(after[1:])) == 1 and after[1] == after[0],
        [a - after[0] for a in after],
        "all 0",
    )


def _active_blocks() -> dict[int, int]:
    """The caching allocator's allocated blocks now: address -> size."""
    found: dict[int, int] = {}
    snapshot: Any = torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]
    for segment in snapshot:
        address = int(segment["address"])
        for block in segment["blocks"]:
            address = int(block.get("address", address))
            if block["state"] == "active_allocated":
                found[address] = int(block["size"])
            address += int(block["size"])
    return found
