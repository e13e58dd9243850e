"""Activation offload on an MLP of blocks: exact results, memory that leaves, files given back.

Every comparison is bit for bit (``torch.equal``) with the plain step on the CPU. Memory is the
offloader's own accounting (``OffloadStats.ram_bytes``: offloadable bytes it holds), compared
with ``measure_only=True`` (the same decisions, nothing written): deterministic, no RSS timing.
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import tensorscope as ts
from tensorscope.errors import ArgumentTypeError, InvalidArgumentError
from tensorscope.fit.offload import ActivationOffloader, offload_blocks

from ._support import assert_same, grads, mlp, mlp_input, released, run_plain

pytestmark = [
    pytest.mark.engine_independent,  # ts.fit outside scopes (checked)
    pytest.mark.strict,  # moves data through the device backend (tests/conftest.py)
]


def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x)
    return out


def test_grads_bit_identical_and_every_group_offloaded() -> None:
    model, x = mlp(), mlp_input()
    loss_plain, expected = run_plain(model, lambda: _step(model, x))
    model.zero_grad(set_to_none=True)
    handle = offload_blocks(model.blocks, min_bytes=0)
    loss = _step(model, x)
    handle.offloader.sync()  # every write done: the backward reads everything back
    loss.backward()
    assert loss.item() == loss_plain
    assert_same(grads(model), expected)
    stats = handle.stats()
    assert sorted(stats.groups) == [0, 1, 2, 3]
    for group in stats.groups.values():
        assert group.offloaded_bytes > 0 and group.offloaded_storages > 0
        assert group.kept.get("PARAMETER", 0) > 0  # the weights are saved, never offloaded
    assert stats.bytes_written > 0 and stats.bytes_read == stats.bytes_written
    assert stats.sync_reads == 0  # every read was a prefetch
    assert stats.write_errors == 0
    assert released(handle.offloader)
    handle.remove()


def test_some_groups_and_a_threshold() -> None:
    model, x = mlp(), mlp_input()
    _, expected = run_plain(model, lambda: _step(model, x))
    model.zero_grad(set_to_none=True)
    with offload_blocks(model.blocks, groups=[1, 3], min_bytes=4096) as handle:
        _step(model, x).backward()
        stats = handle.stats()
    assert_same(grads(model), expected)
    assert sorted(stats.groups) == [1, 3]
    for group in stats.groups.values():
        assert group.kept.get("SMALL", 0) > 0  # layer-norm statistics (16 rows)
        assert group.offloaded_bytes > 0  # the 16 x 64 float tensors (4 KiB)


def test_memory_leaves_bounded_by_in_flight() -> None:
    width, rows, depth = 256, 256, 6
    model, x = mlp(width, depth), mlp_input(rows, width)
    in_flight = 1 << 20
    peaks = {}
    for measure_only in (True, False):
        model.zero_grad(set_to_none=True)
        with offload_blocks(
            model.blocks, min_bytes=0, max_in_flight_bytes=in_flight, measure_only=measure_only
        ) as handle:
            loss = _step(model, x)
            forward_peak = handle.stats().peak_ram_bytes
            group_bytes = max(g.offloaded_bytes for g in handle.stats().groups.values())
            loss.backward()
            del loss
            assert released(handle.offloader)
            peaks[measure_only] = (forward_peak, handle.stats().peak_ram_bytes, group_bytes)
    total_forward, _, group_bytes = peaks[True]
    offloaded_forward, offloaded_peak, _ = peaks[False]
    assert total_forward >= depth * group_bytes * 0.99  # everything stays without offload
    largest = 2 * rows * width * 4
    assert offloaded_forward <= in_flight + largest  # the writer keeps up, by construction
    # the backward holds at most two groups read back (this one and the one before)
    assert offloaded_peak <= max(in_flight + largest, 2 * group_bytes + largest)
    assert offloaded_peak < total_forward / 2


def test_graph_freed_without_backward_releases_files() -> None:
    model, x = mlp(), mlp_input()
    handle = offload_blocks(model.blocks, min_bytes=0)
    loss = _step(model, x)
    handle.offloader.sync()
    assert handle.stats().tier_bytes > 0
    del loss
    assert released(handle.offloader)
    handle.remove()


def test_backward_that_raises_midway_releases_everything() -> None:
    model, x = mlp(), mlp_input()
    handle = offload_blocks(model.blocks, min_bytes=0)
    h = model.blocks[1](model.blocks[0](x))

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")

    h.register_hook(fail)
    for block in model.blocks[2:]:
        h = block(h)
    loss = model.head(h).square().mean()
    with pytest.raises(RuntimeError, match="boom in backward"):
        loss.backward()
    del loss, h
    assert released(handle.offloader)
    handle.remove()


def test_retain_graph_backward_twice_and_double_backward() -> None:
    model, x = mlp(), mlp_input()
    model.zero_grad(set_to_none=True)
    loss = _step(model, x)
    loss.backward(retain_graph=True)
    loss.backward()
    expected = grads(model)
    x2 = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(_step(model, x2), x2, create_graph=True)
    (expected_ggx,) = torch.autograd.grad(gx.square().sum(), x2)

    model.zero_grad(set_to_none=True)
    with offload_blocks(model.blocks, min_bytes=0) as handle:
        loss = _step(model, x)
        loss.backward(retain_graph=True)
        loss.backward()  # every saved tensor unpacked twice
        assert_same(grads(model), expected)
        x3 = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(_step(model, x3), x3, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.square().sum(), x3)
        assert torch.equal(ggx, expected_ggx)
        del loss, gx
        assert released(handle.offloader)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_outside_the_block_steps_aside(reentrant: bool) -> None:
    model, x = mlp(), mlp_input()
    _, expected = run_plain(model, lambda: _step(model, x))
    model.zero_grad(set_to_none=True)
    with offload_blocks(model.blocks, min_bytes=0) as handle:
        h = x.requires_grad_() if reentrant else x
        for index, block in enumerate(model.blocks):
            if index % 2 == 0:
                h = torch_checkpoint.checkpoint(block, h, use_reentrant=reentrant)
            else:
                h = block(h)
        model.head(h).square().mean().backward()
        groups = handle.stats().groups
    assert_same(grads(model), expected)
    assert sorted(groups) == [1, 3]  # checkpointed blocks ran under checkpoint's hooks / no grad


def test_checkpoint_inside_the_block() -> None:
    model, x = mlp(), mlp_input()
    _, expected = run_plain(model, lambda: _step(model, x))
    model.zero_grad(set_to_none=True)
    for block in model.blocks:
        block.inner_checkpoint = True
    with offload_blocks(model.blocks, min_bytes=0) as handle:
        _step(model, x).backward()
        groups = handle.stats().groups
    assert_same(grads(model), expected)
    assert all(group.offloaded_bytes > 0 for group in groups.values())


def test_autocast() -> None:
    model, x = mlp(), mlp_input()

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _step(model, x)

    loss_plain, expected = run_plain(model, step)
    model.zero_grad(set_to_none=True)
    with offload_blocks(model.blocks, min_bytes=0) as handle:
        loss = step()
        loss.backward()
        stats = handle.stats()
    assert loss.item() == loss_plain
    assert_same(grads(model), expected)
    # autocast's bfloat16 copies of the weights are casts of parameters: kept
    assert all(group.kept.get("PARAMETER", 0) > 0 for group in stats.groups.values())


@pytest.mark.engine_dependent  # scopes or ts.manage
@pytest.mark.parametrize("moved", [False, True])
def test_inside_a_scope(moved: bool) -> None:
    model, x = mlp(), mlp_input()
    _, expected = run_plain(model, lambda: _step(model, x))
    model.zero_grad(set_to_none=True)
    with offload_blocks(model.blocks, min_bytes=0) as handle:
        with ts.scope() as scope:
            xs = x.clone()  # a ref of the scope, saved by the first block
            loss = _step(model, xs)
            if moved:
                loss = scope.move_to_outer(loss)  # backward after the scope disposed its refs
            else:
                loss.backward()
        if moved:
            loss.backward()
            del loss
        assert released(handle.offloader)
    assert_same(grads(model), expected)


@pytest.mark.cpu_backend  # the disk tier's files
def test_remove_restores_the_modules_and_files_go() -> None:
    model, x = mlp(), mlp_input()
    before = [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in model.blocks]
    handle = offload_blocks(model.blocks, min_bytes=0)
    directory = handle.offloader.directory
    assert directory is not None and os.path.isdir(directory)
    loss = _step(model, x)  # a graph alive across remove(): it still works
    handle.remove()
    handle.remove()  # idempotent
    assert [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in model.blocks] == before
    loss.backward()
    del loss
    gc.collect()
    handle.offloader.sync()
    assert not os.path.exists(directory)  # the last entry released: the tier is closed
    with pytest.raises(ts.ResidencyError):
        handle.offloader.group(0)


def test_forward_that_raises_pops_the_hooks() -> None:
    model = mlp()
    with offload_blocks(model.blocks, min_bytes=0):
        with pytest.raises(RuntimeError):
            model(torch.randn(4, 5))  # wrong width: the first block raises
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_no_grad_and_eval_do_nothing() -> None:
    model, x = mlp(), mlp_input()
    with offload_blocks(model.blocks, min_bytes=0) as handle:
        with torch.no_grad():
            _step(model, x)
        assert handle.stats().groups == {}


def test_manual_groups_and_shared_storages() -> None:
    offloader = ActivationOffloader("cpu", min_bytes=0)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(32, 32)
    with offloader.group(0):
        h = (x @ w).exp()  # exp saves its output
        a, b = h.split(16)  # two views of one storage, both saved
        loss = (a * b).sum()
    stats = offloader.stats().groups[0]
    assert stats.shared_bytes > 0  # the second view shares the first one's entry
    offloader.prefetch(0)
    loss.backward()
    grad = w.grad
    assert grad is not None
    w.grad = None
    h = (x @ w).exp()
    a, b = h.split(16)
    (a * b).sum().backward()
    assert torch.equal(grad, w.grad)
    del loss
    assert released(offloader)
    offloader.close()


def test_bad_arguments() -> None:
    model = mlp()
    with pytest.raises(InvalidArgumentError):
        offload_blocks(model.blocks, groups=[7])
    with pytest.raises(ArgumentTypeError):
        offload_blocks([object()])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        ActivationOffloader("cpu", min_bytes=-1)
    with pytest.raises(ts.ResidencyError):
        ActivationOffloader("meta")


def test_measure_bandwidth() -> None:
    offloader = ActivationOffloader("cpu")
    bandwidth = offloader.measure_bandwidth(nbytes=4 << 20)
    assert bandwidth.write_bytes_per_s > 0 and bandwidth.read_bytes_per_s > 0
    assert bandwidth.per_tensor_s > 0
    assert bandwidth.seconds(8 << 20, tensors=2) > 0
    offloader.close()


@pytest.mark.gpu
def test_cuda_pinned_host() -> None:  # pragma: no cover - needs a CUDA device
    model, x = mlp().cuda(), mlp_input().cuda()
    _, expected = run_plain(model, lambda: _step(model, x))
    model.zero_grad(set_to_none=True)
    with offload_blocks(model.blocks, min_bytes=0) as handle:
        _step(model, x).backward()
        torch.cuda.synchronize()
        assert handle.offloader.tier == "host"
        assert handle.stats().bytes_written > 0
    assert_same(grads(model), expected)


class _HeldStore:
    """Wraps a store: writes wait until ``go`` is set, or fail when ``fail`` is set."""

    def __init__(self, store: Any, fail: bool = False) -> None:
        self._store = store
        self.go = threading.Event()
        self.fail = fail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def finish(self, storage: torch.UntypedStorage, started: Any) -> Any:
        if self.fail:
            raise OSError(28, "No space left on device")
        self.go.wait(30)
        return self._store.finish(storage, started)


def test_in_place_change_during_the_write_raises_like_autograd() -> None:
    offloader = ActivationOffloader("cpu", min_bytes=0)
    held = _HeldStore(offloader._engine.store)
    offloader._engine.store = held
    w = torch.randn(16, 16, requires_grad=True)
    with offloader.group(0):
        h = (torch.randn(16, 16) @ w).exp()  # exp saves its output, h
        loss = h.sum()
    h.mul_(2)  # the in-place change autograd would refuse at backward
    held.go.set()
    offloader.sync()
    with pytest.raises(RuntimeError, match="in-place"):
        loss.backward()
    del loss, h
    assert released(offloader)
    offloader.close()


def test_a_failed_write_keeps_the_tensor_in_memory() -> None:
    model, x = mlp(), mlp_input()
    _, expected = run_plain(model, lambda: _step(model, x))
    model.zero_grad(set_to_none=True)
    with offload_blocks(model.blocks, min_bytes=0) as handle:
        engine = handle.offloader._engine
        engine.store = _HeldStore(engine.store, fail=True)
        loss = _step(model, x)
        handle.offloader.sync()  # every write tried (and failed) before backward needs them
        loss.backward()
        del loss
        stats = handle.stats()
        assert released(handle.offloader)
    assert_same(grads(model), expected)
    assert stats.write_errors > 0 and stats.last_error is not None
    assert "No space left" in stats.last_error
