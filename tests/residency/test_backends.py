"""Device backends (residency/backends): the strict backend's late copies, the pinned pool and its
pageable fallback, how a backend is chosen, and that nothing above the package asks which device
it is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import tensorscope
from tensorscope._torch import new_storage, swap_data_ptr, tensor_over
from tensorscope.errors import InvalidArgumentError, ResidencyError
from tensorscope.residency.backends import DONE, Refused, backend_for
from tensorscope.residency.backends.cpu import CpuBackend
from tensorscope.residency.backends.pinned import PinnedPool
from tensorscope.residency.backends.strict import StrictBackend

pytestmark = pytest.mark.engine_independent  # storages and copies only: no scope, no ref


def _filled(nbytes: int, value: int) -> torch.UntypedStorage:
    storage = new_storage(nbytes)
    tensor_over(storage, torch.uint8, (nbytes,)).fill_(value)
    return storage


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return tensor_over(storage, torch.uint8, (storage.nbytes(),))


# ----------------------------------------------------------------------------- late copies
def test_a_copy_to_the_device_holds_poison_until_waited_then_lands() -> None:
    backend = StrictBackend()
    host = backend.staging(64)
    tensor_over(host, torch.float32, (16,)).copy_(torch.arange(16.0))
    device = backend.allocate(64)
    pending = backend.copy_in(device, host, background=True)
    floats = tensor_over(device, torch.float32, (16,))
    assert floats.isnan().all()  # NaN in a floating dtype...
    assert (tensor_over(device, torch.int32, (16,)) == -1).all()  # -1 in a signed integer...
    assert (tensor_over(device, torch.bool, (64,)).view(torch.uint8) == 0xFF).all()  # ...bytes
    pending.wait()  # ops on the device read it next: it lands
    assert torch.equal(floats, torch.arange(16.0)) and backend.landed_late == 1


def test_a_copy_to_the_host_lands_for_the_host_only_when_synchronized() -> None:
    backend = StrictBackend()
    device = _filled(32, 7)
    host = backend.staging(32)
    pending = backend.copy_out(host, device)
    pending.wait()  # the compute stream waits: the host itself does not
    assert (_bytes(host) == 0xFF).all()
    pending.synchronize()
    assert (_bytes(host) == 7).all()


def test_a_copy_on_the_compute_stream_runs_after_what_that_stream_waited_for() -> None:
    backend = StrictBackend()
    host, device = backend.staging(32), _filled(32, 3)
    backend.copy_out(host, device).wait()  # demoted, the compute stream waited
    again = backend.allocate(32)
    assert backend.copy_in(again, host) is DONE  # promoted on the compute stream
    assert (_bytes(again) == 3).all()
    unordered, other = backend.staging(32), _filled(32, 4)
    backend.copy_out(unordered, other)  # nobody waited: a missing wait
    wrong = backend.allocate(32)
    backend.copy_in(wrong, unordered)
    assert (_bytes(wrong) == 0xFF).all()  # what the missing wait reads: poison


def test_copies_on_one_stream_land_in_order_and_read_their_source_late() -> None:
    backend = StrictBackend()
    first, second = backend.staging(16), backend.staging(16)
    source, other = _filled(16, 1), _filled(16, 2)
    early = backend.copy_out(first, source)
    late = backend.copy_out(second, other)
    _bytes(source).fill_(9)  # changed before the first copy ran: it copies the change
    late.synchronize()  # the first was queued before it on the same stream
    assert (_bytes(first) == 9).all() and (_bytes(second) == 2).all()
    early.synchronize()  # landed already: nothing happens again
    assert backend.landed_late == 2


def test_release_keeps_memory_a_copy_still_reads_and_a_swap_behind_its_back_raises() -> None:
    backend = StrictBackend()
    device, host = _filled(32, 5), backend.staging(32)
    pending = backend.copy_out(host, device)
    backend.release(device)  # given back at once: the copy still gets its bytes
    assert device.nbytes() == 0
    pending.synchronize()
    assert (_bytes(host) == 5).all()
    device, host = _filled(32, 6), backend.staging(32)
    pending = backend.copy_out(host, device)
    swap_data_ptr(device, new_storage(0))  # taken from under the copy, not through release
    with pytest.raises(ResidencyError, match="left its storage before the copy landed"):
        pending.synchronize()


def test_pageable_memory_is_copied_at_once_and_a_full_device_refuses() -> None:
    backend = StrictBackend()
    pageable = _filled(16, 8)  # not from the pinned pool
    device = backend.allocate(16)
    assert backend.copy_in(device, pageable, background=True) is not DONE  # staged: pinned
    backend.pool.limit = 0  # no pinned memory left: the copy is blocking, done when it returns
    assert backend.copy_in(device, pageable, background=True) is DONE
    assert (_bytes(device) == 8).all() and backend.pool.fallbacks == 1
    backend.device_full = True
    with pytest.raises(Refused, match="device memory is full"):
        backend.allocate(16)


def test_a_cpu_backend_copies_synchronously() -> None:
    backend = backend_for("cpu")
    assert isinstance(backend, CpuBackend) and backend.tiers == ("device", "disk")
    device = backend.allocate(8)
    assert backend.copy_in(device, _filled(8, 2), background=True) is DONE
    assert (_bytes(device) == 2).all()


# ---------------------------------------------------------------------------- pinned pool
def test_the_pinned_pool_falls_back_past_its_limit_and_after_a_failed_pin() -> None:
    failing = [False]

    def pin(nbytes: int) -> torch.UntypedStorage:
        if failing[0]:
            raise RuntimeError("cudaHostAlloc failed: out of memory\n(more)")
        return new_storage(nbytes)

    pool = PinnedPool(pin, limit=100)
    first = pool.take(60)
    assert first is not None and pool.holds(first) and pool.live_bytes == 60
    assert pool.take(60) is None and pool.fallbacks == 1 and "limit of 100 B" in str(pool.why)
    del first  # given back: the pool has room again
    assert pool.live_bytes == 0
    failing[0] = True
    assert pool.take(10) is None and "cudaHostAlloc failed: out of memory" in str(pool.why)
    failing[0] = False
    assert pool.take(10) is None and pool.fallbacks == 3  # not tried again until a block returns
    assert not pool.holds(new_storage(8))


# ------------------------------------------------------------------------- which backend
def test_the_variable_chooses_the_strict_backend_and_a_bad_value_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TENSORSCOPE_BACKEND", "strict")
    strict = backend_for("cpu")
    assert isinstance(strict, StrictBackend) and strict.tiers == ("device", "host", "disk")
    assert backend_for(torch.device("cpu")) is strict  # one per device and kind
    monkeypatch.setenv("TENSORSCOPE_BACKEND", "fast")
    with pytest.raises(InvalidArgumentError, match="TENSORSCOPE_BACKEND='fast'"):
        backend_for("cpu")
    monkeypatch.delenv("TENSORSCOPE_BACKEND")
    with pytest.raises(InvalidArgumentError, match="not supported"):
        backend_for("meta")


# ----------------------------------------------------------- nothing else asks the device
_PACKAGE = Path(tensorscope.__file__).parent
# What moves bytes between tiers: the residency package and fit's stores, offload and placer.
_MOVING = [
    *(
        path
        for path in (_PACKAGE / "residency").rglob("*.py")
        if "backends" not in path.relative_to(_PACKAGE).parts
    ),
    *(_PACKAGE / "fit").glob("offload*.py"),
    _PACKAGE / "fit" / "statestore.py",
    _PACKAGE / "fit" / "paramplace.py",
]
_DEVICE_NAMES = {"cpu", "cuda"}
_CUDA_WORDS = {"is_cpu", "is_cuda", "record_stream", "pin_memory", "non_blocking"}


def _device_branches(path: Path) -> list[str]:
    """Where ``path`` asks which device it is (``x.type == "cuda"``, ``is_cpu``, ``torch.cuda``,
    pinned memory, non-blocking copies): the backends' questions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Constant) and s.value in _DEVICE_NAMES for s in sides)
            typed = any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides)
            if named and typed:
                found.append(f"{path.name}:{line}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute):
            torch_cuda = node.attr == "cuda" and ast.unparse(node.value) == "torch"
            if node.attr in _CUDA_WORDS or torch_cuda:
                found.append(f"{path.name}:{line}: {ast.unparse(node)}")
        elif isinstance(node, ast.keyword) and node.arg in _CUDA_WORDS:
            found.append(f"{path.name}:{line}: {node.arg}=")
    return found


def test_nothing_outside_the_backends_asks_which_device_it_is() -> None:
    assert len(_MOVING) > 20  # the scan sees the modules it means
    found = [hit for path in _MOVING for hit in _device_branches(path)]
    assert not found, "ask the device's backend (residency/backends) instead:\n" + "\n".join(found)


def test_the_scan_finds_what_it_forbids(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f(t, d, s):\n"
        "    if d.type == 'cuda' or 'cpu' != t.device.type:\n"
        "        torch.cuda.synchronize()\n"
        "    s.copy_(t, non_blocking=True)\n"
        "    return d.is_cpu\n"
        "def g(t):\n"
        "    return t.device.type == 'meta' or t.device.type == g.type\n"
    )
    assert len(_device_branches(sample)) == 5
