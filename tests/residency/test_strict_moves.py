"""The CUDA backend's rules, checked on the CPU by the strict backend: a mover or a store that
forgets a wait reads poison, deterministically; an allocator that refuses leaves the data where
it was; pinned memory that runs out falls back to pageable copies, and the report says so."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.fit.offload import offload_blocks
from tensorscope.fit.offload_store import HostStore
from tensorscope.residency.backends.strict import StrictBackend
from tensorscope.residency.movers import Movers
from tensorscope.residency.placement import Placement

EXPECTED = float(sum(range(4096)))  # the sum of the tensor every test moves


@pytest.fixture
def strict(monkeypatch: pytest.MonkeyPatch) -> Iterator[StrictBackend]:
    """The residency manager on the strict backend (one per process: what a test changes on it
    is put back here, before the manager is reset)."""
    monkeypatch.setenv("TENSORSCOPE_BACKEND", "strict")
    ts.residency.configure(device="cpu", policy="genoa", budget="1MiB")
    backend = ts.residency.backend
    assert isinstance(backend, StrictBackend) and backend.pool is not None
    limit = backend.pool.limit
    try:
        yield backend
    finally:
        backend.device_full = False
        backend.pool.limit = limit


def _total(t: torch.Tensor) -> float:
    with ts.scope():
        return float(t.sum().item())


class _Forgetful(Movers):
    """A deliberately broken mover: it drops the event of a background copy."""

    def _promote(self, placement: Placement, background: bool) -> float:
        seconds = super()._promote(placement, background)
        placement.pending = None  # forgotten: nothing waits for the copy
        return seconds


@pytest.mark.parametrize("broken", [False, True])
def test_a_prefetch_nobody_waits_for_reads_poison(
    strict: StrictBackend, monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    t = ts.ref(torch.arange(4096, dtype=torch.float32))
    t.demote()  # to the host: a copy out, then the device memory goes back
    placement = ts.residency.placement_of(t)
    assert placement is not None and placement.tier == "host"
    if broken:
        monkeypatch.setattr(ts.residency, "_movers", _Forgetful(strict, ts.residency.disk))
    landed = strict.landed_late
    ts.residency.prefetch(placement)  # a copy in on the copy stream
    assert placement.tier == "device"
    total = _total(t)
    if broken:
        assert total != total  # NaN: the op read the poisoned destination
    else:
        assert total == EXPECTED and strict.landed_late >= landed + 2  # both copies were late


@pytest.mark.parametrize("broken", [False, True])
def test_a_host_buffer_written_to_disk_before_its_copy_landed_loses_the_bytes(
    strict: StrictBackend, monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    t = ts.ref(torch.arange(4096, dtype=torch.float32))
    if broken:  # a mover that orders the compute stream where the host reads the bytes
        real = Placement.wait
        monkeypatch.setattr(Placement, "wait", lambda self, host=False: real(self))
    t.demote("host")
    t.demote("disk")  # the CPU reads the host buffer: it must synchronize first
    t.promote()
    total = _total(t)
    assert (total != total) if broken else total == EXPECTED


def test_a_refused_allocation_leaves_the_tensor_where_it_was_and_names_it(
    strict: StrictBackend,
) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    expected = model(torch.ones(2, 64)).detach()
    handle = ts.manage(model)
    weight = model[1].weight
    weight.demote()  # type: ignore[operator]
    placement = ts.residency.placement_of(weight)
    assert placement is not None
    strict.device_full = True
    with pytest.raises(ts.ResidencyError, match=r"moving 1\.weight .* stays on the host tier"):
        weight.promote()  # type: ignore[operator]
    with ts.scope(), pytest.raises(ts.ResidencyError, match=r"moving 0\.weight \(16\.0 KiB\)"):
        model(torch.ones(2, 64))  # an op that needs a weight: the same error, nothing moved
    ts.residency.prefetch(placement)  # a prefetch the allocator refuses is skipped
    assert weight.tier == "host"  # type: ignore[attr-defined]
    strict.device_full = False
    with ts.scope():
        assert torch.equal(model(torch.ones(2, 64)), expected)
    handle.remove()


def test_exhausted_pinned_memory_falls_back_to_pageable_copies_and_the_report_says_so(
    strict: StrictBackend,
) -> None:
    t = ts.ref(torch.arange(4096, dtype=torch.float32))
    assert strict.pool is not None
    before = strict.pool.fallbacks
    strict.pool.limit = 0
    t.demote()  # the host buffer is pageable: a blocking copy
    placement = ts.residency.placement_of(t)
    assert placement is not None and placement.tier == "host" and placement.pending is None
    report = ts.residency.report()
    assert report.pageable_copies == before + 1 and report.pinned_limit_bytes == 0
    assert "copies through pageable memory instead (the pinned pool's limit of 0 B" in str(report)
    assert _total(t) == EXPECTED


@pytest.mark.engine_independent  # activation offload outside scopes
@pytest.mark.parametrize("broken", [False, True])
def test_an_offloaded_activation_unpacked_before_its_read_landed_is_poison(
    monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    monkeypatch.setenv("TENSORSCOPE_BACKEND", "strict")
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])
    x = torch.randn(16, 64)
    blocks(x).square().sum().backward()
    expected = [p.grad.clone() for p in blocks.parameters()]  # type: ignore[union-attr]
    blocks.zero_grad(set_to_none=True)
    if broken:  # a store whose unpack does not wait for its read
        monkeypatch.setattr(HostStore, "ready", lambda self, loaded: loaded[0])
    with offload_blocks(list(blocks), min_bytes=0) as handle:
        assert handle.offloader.tier == "host"
        loss = blocks(x).square().sum()
        handle.offloader.sync()  # every activation written out: backward reads them back
        loss.backward()
    grads = [p.grad for p in blocks.parameters()]
    if broken:
        assert any(g is not None and g.isnan().any() for g in grads)
    else:
        assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))  # type: ignore[arg-type]
