"""A checkpoint larger than the page cache can hold is streamed: each placement's pages leave the
page cache once it leaves the device (see the NOTE in ``DiskTier.streams``); a smaller one keeps
its pages cached for the next forward."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import tensorscope as ts

MiB = 1 << 20
_mincore = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _cached_pages(path: Path, offset: int, length: int) -> int:
    """How many pages of ``path``'s bytes [offset, offset + length) are in the page cache."""
    size = path.stat().st_size
    vector = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as mapping:
        start = ctypes.c_char.from_buffer(mapping)  # the mapping's address (nothing is written)
        assert _mincore(ctypes.addressof(start), size, vector) == 0
        del start  # release the buffer before the mapping closes
    first, last = offset // mmap.PAGESIZE, (offset + length - 1) // mmap.PAGESIZE
    return sum(1 for page in range(first, last + 1) if vector[page] & 1)


def _checkpoint(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Six linears with 1 MiB weights, written and synced (clean pages can leave the cache)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    x = torch.randn(4, 512)
    with torch.no_grad():
        return x, model(x)


def _forward_then_cached(path: Path, x: torch.Tensor, expected: torch.Tensor) -> list[int]:
    """One forward under a budget of 2.5 weights; then the cached pages of each weight that
    is back on the disk tier."""
    manager = ts.residency
    manager.configure(device="cpu", policy="flow", budget=int(2.5 * MiB))
    with ts.empty_init():
        model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6)))
    handle = ts.manage(model, checkpoint=path)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        cached = []
        for layer in model:
            placement = manager.placement_of(layer.weight)
            assert placement is not None and placement.region is not None
            if placement.tier == "disk":
                region = placement.region
                cached.append(_cached_pages(path, region.offset, region.nbytes))
    finally:
        handle.remove()
    assert cached, "the budget holds 2 of 6 weights: some went back to the disk tier"
    return cached


def _drops_clean_pages(path: Path) -> bool:
    """Whether this filesystem drops clean pages on POSIX_FADV_DONTNEED (tmpfs does not)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.pread(fd, 1 << 16, 0)
        os.posix_fadvise(fd, 0, 1 << 16, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return _cached_pages(path, 0, 1 << 16) == 0


def test_a_checkpoint_larger_than_memory_leaves_the_page_cache_after_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.safetensors"
    x, expected = _checkpoint(path)
    if not _drops_clean_pages(path):
        pytest.skip("this filesystem keeps file pages in memory (tmpfs): nothing to drop")
    monkeypatch.setattr(ts.residency.disk, "memory", 4 * MiB)  # less than the checkpoint
    cached = _forward_then_cached(path, x, expected)
    # 256 pages each; a page shared with a neighbour still mapped (the bias) stays.
    assert all(pages <= 2 for pages in cached), cached


def test_a_checkpoint_that_fits_keeps_its_pages_cached(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    x, expected = _checkpoint(path)
    assert not ts.residency.disk.streams(int(2.5 * MiB))  # 3 MiB on a machine with GiBs
    cached = _forward_then_cached(path, x, expected)
    assert all(pages >= MiB // mmap.PAGESIZE for pages in cached), cached


def test_streaming_needs_a_known_memory_size_and_a_mapped_checkpoint(tmp_path: Path) -> None:
    disk = ts.residency.disk
    assert not disk.streams(1 << 60)  # no checkpoint mapped: nothing to stream
    path = tmp_path / "model.safetensors"
    _checkpoint(path)
    region = disk.checkpoint_region(str(path), 0, 4096)
    try:
        memory = disk.memory
        assert disk.streams(memory)  # the file and the resident bytes pass the memory
        assert not disk.streams(0)
        disk.memory = 0  # unknown: leave the page cache to the kernel
        assert not disk.streams(1 << 60)
    finally:
        disk.memory = memory
        disk.release(region, reusable=False)
