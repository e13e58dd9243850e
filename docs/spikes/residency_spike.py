"""Spike: two ways to move a tensor's data between tiers behind the user's back.

(a) wrapper: a ``_make_wrapper_subclass`` tensor whose data lives in a shared cell (a one-slot
    list holding the inner tensor); every wrapper of the same data points at the same cell, so
    swapping the cell's content moves the data for all of them.
(b) storage: the tensor keeps its TensorImpl and storage object; demotion copies the bytes out
    and ``resize_(0)``s the storage, promotion ``resize_``s it back and copies the bytes in
    (FSDP's pattern). Views, autograd's saved tensors and optimizer references share the
    storage and see the data come back.

Run: ``python docs/spikes/residency_spike.py``; it checks both designs for exact gradients when
data moves during backward and prints per-op overhead and move costs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch.utils._pytree import tree_map


# ---------------------------------------------------------------- (a) wrapper with a shared cell
class CellTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, cell: list[torch.Tensor]) -> CellTensor:
        inner = cell[0]
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            inner.shape,
            strides=inner.stride(),
            dtype=inner.dtype,
            device=inner.device,
            requires_grad=inner.requires_grad,
        )
        out.cell = cell
        return out  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.cell[0] if isinstance(x, CellTensor) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def demote_cell(t: CellTensor) -> torch.Tensor:
    host = t.cell[0].clone()
    t.cell[0] = torch.empty(0)
    return host


def promote_cell(t: CellTensor, host: torch.Tensor) -> None:
    t.cell[0] = host


# ------------------------------------------------------------------ (b) storage-level resize
def demote_storage(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    host = torch.empty(storage.nbytes(), dtype=torch.uint8)
    host.untyped_storage().copy_(storage)
    storage.resize_(0)
    return host


def promote_storage(t: torch.Tensor, host: torch.Tensor) -> None:
    storage = t.untyped_storage()
    storage.resize_(host.numel())
    storage.copy_(host.untyped_storage())


# ----------------------------------------------------------------------------------- checks
def gradient_check() -> tuple[bool, bool]:
    torch.manual_seed(0)
    w0 = torch.randn(8, 8)
    x = torch.randn(4, 8)
    reference = w0.clone().requires_grad_()
    expected_w = torch.autograd.grad(((x @ reference).tanh() @ reference).sum(), [reference])[0]

    # (b): w's data leaves and comes back between forward and backward
    w = w0.detach().clone().requires_grad_()
    y = ((x @ w).tanh() @ w).sum()
    host = demote_storage(w)
    promote_storage(w, host)
    (gw,) = torch.autograd.grad(y, [w])
    storage_ok = torch.allclose(gw, expected_w)

    # (a): same with the cell design
    cell = [w0.detach().clone()]
    wc = CellTensor(cell).requires_grad_()
    yc = ((x @ wc).tanh() @ wc).sum()
    saved = demote_cell(wc)
    promote_cell(wc, saved)
    (gwc,) = torch.autograd.grad(yc, [wc])
    cell_ok = torch.allclose(gwc.cell[0] if isinstance(gwc, CellTensor) else gwc, expected_w)
    return storage_ok, cell_ok


def per_op_us(a: torch.Tensor, b: torch.Tensor, n: int = 20000) -> float:
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            a + b
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def move_ms(nbytes: int) -> tuple[float, float]:
    t = torch.ones(nbytes // 4)
    demote_times, promote_times = [], []
    for _ in range(5):
        start = time.perf_counter()
        host = demote_storage(t)
        mid = time.perf_counter()
        promote_storage(t, host)
        end = time.perf_counter()
        demote_times.append((mid - start) * 1e3)
        promote_times.append((end - mid) * 1e3)
    return statistics.median(demote_times), statistics.median(promote_times)


def main() -> None:
    storage_ok, cell_ok = gradient_check()
    print(f"exact gradients after a move during backward: storage {storage_ok}, cell {cell_ok}")
    plain = per_op_us(torch.randn(64), torch.randn(64))
    cell = per_op_us(CellTensor([torch.randn(64)]), CellTensor([torch.randn(64)]))
    print(
        f"64-element add: plain {plain:.2f} us, cell wrapper {cell:.2f} us "
        f"(+{cell - plain:.2f}); storage design adds nothing to ops on unmanaged tensors"
    )
    demote, promote = move_ms(64 * 1024 * 1024)
    print(
        f"storage design, 64 MiB host round trip: demote {demote:.1f} ms, promote {promote:.1f} ms"
    )


if __name__ == "__main__":
    main()
