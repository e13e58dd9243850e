"""The storage door (tensorscope/_torch.py's NOTE): torch 2.13's ``_swap_data_ptr_``, or
tensorscope's C++ module ``_storage`` where torch has no such method (2.11), or a clear error."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope import _torch
from tensorscope.residency.disk import DiskTier
from tensorscope.residency.tiers import move_into_file


def _extension() -> object:
    try:
        return importlib.import_module("tensorscope._storage")
    except ImportError:
        pytest.skip("tensorscope._storage is not built here (no C++ compiler)")


def _over(storage: torch.UntypedStorage, n: int) -> torch.Tensor:
    return torch.empty(0).set_(storage, 0, (n,), (1,))


def test_the_extension_exchanges_memory_sizes_and_allocators() -> None:
    module: object = _extension()
    a = torch.arange(6.0).untyped_storage()
    b = torch.full((2,), 7.0).untyped_storage()
    view = _over(a, 6)[2:]  # a view follows its storage
    pointers = (a.data_ptr(), b.data_ptr())
    module.swap(a, b)  # type: ignore[attr-defined]
    assert (a.data_ptr(), b.data_ptr()) == pointers[::-1]
    assert (a.nbytes(), b.nbytes()) == (8, 24)
    assert torch.equal(_over(a, 2), torch.full((2,), 7.0))
    assert torch.equal(_over(b, 6), torch.arange(6.0))
    a.resize_(16)  # each storage resizes through the allocator that came with its memory
    assert torch.equal(_over(a, 2), torch.full((2,), 7.0))
    module.swap(a, a)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="two UntypedStorages"):
        module.swap(a, view)  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="torch < 2.13")
def test_the_extension_leaves_storages_as_torch_does() -> None:
    module: object = _extension()
    ours = (torch.arange(4.0).untyped_storage(), torch.zeros(0).untyped_storage())
    theirs = (torch.arange(4.0).untyped_storage(), torch.zeros(0).untyped_storage())
    module.swap(*ours)  # type: ignore[attr-defined]
    theirs[0]._swap_data_ptr_(theirs[1])  # type: ignore[attr-defined]
    for mine, torchs in zip(ours, theirs, strict=True):
        assert mine.nbytes() == torchs.nbytes()
        assert mine.resizable() == torchs.resizable()
        assert bytes(mine.cpu()) == bytes(torchs.cpu())


def test_residency_moves_through_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch 2.11 runs: every move of a managed model through tensorscope._storage."""
    module: object = _extension()
    monkeypatch.setattr(_torch, "STORAGE_DOOR", "extension")
    calls = []
    real = module.swap  # type: ignore[attr-defined]
    monkeypatch.setattr(_torch, "_extension_swap", lambda a, b: calls.append(1) or real(a, b))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    plain.load_state_dict(model.state_dict())
    x = torch.randn(8, 64)
    ts.residency.configure(budget=20_000)  # one weight at a time
    with ts.manage(model):
        assert {p.tier for p in model.parameters()} >= {"disk"}  # type: ignore[attr-defined]
        for _ in range(2):
            assert torch.equal(model(x), plain(x))
    assert calls  # the moves went through the extension
    assert all(type(p) is nn.Parameter for p in model.parameters())


def test_without_a_door_residency_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch, "STORAGE_DOOR", "")
    monkeypatch.setattr(_torch, "_extension_swap", None)
    with pytest.raises(ts.ResidencyError, match=r"_swap_data_ptr_.*tensorscope\._storage"):
        ts.residency.configure(budget="1MiB")
    with pytest.raises(ts.ResidencyError, match="build_ext"):
        ts.manage(nn.Linear(4, 4))
    with pytest.raises(ts.ResidencyError, match="nothing can move"):
        _torch.swap_data_ptr(torch.zeros(1).untyped_storage(), torch.zeros(0).untyped_storage())
    disk = DiskTier(None)
    try:
        storage = torch.ones(1024).untyped_storage()
        with pytest.raises(ts.ResidencyError):
            move_into_file(disk, storage)
        assert disk.live_bytes == 0  # refused before writing anything
        assert torch.equal(_over(storage, 1024), torch.ones(1024))
    finally:
        disk.close()
