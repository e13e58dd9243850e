"""Explicit moves: where data lives, and that nothing referring to it changes identity."""

from __future__ import annotations

import os

import pytest
import torch

import tensorscope as ts


@pytest.mark.strict
def test_demote_and_promote_keep_identity_views_and_data() -> None:
    t = ts.ref(torch.arange(4096, dtype=torch.float32))
    view = t[100:200]
    before = t.clone()
    assert t.tier == "device"
    t.demote()
    below = ts.residency.tiers[1]  # "disk" below the CPU
    assert t.tier == below and ts.residency.tier_of(view) == below
    assert torch.equal(view, before[100:200])  # a view reads the data back wherever it is
    t.promote()
    assert t.tier == "device"
    t.add_(1)
    assert torch.equal(view, before[100:200] + 1)  # same storage: the view sees the write


def test_demote_to_an_unknown_or_absent_tier_is_a_clear_error() -> None:
    t = ts.ref(torch.ones(16))
    with pytest.raises(ts.InvalidArgumentError, match="unknown tier"):
        t.demote("floppy")
    with pytest.raises(ts.ResidencyError, match="no host tier"):
        t.demote("host")  # the device is the CPU: no host tier
    assert t.tier == "device"


@pytest.mark.strict
def test_autograd_saved_tensors_and_optimizer_references_survive_moves() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.SGD([w], lr=0.1)
    x = torch.randn(4, 8)
    expected_w = w.detach().clone().requires_grad_()
    (x @ expected_w).tanh().sum().backward()
    loss = (x @ w).tanh().sum()
    ts.residency.demote(w)  # parameters are moved through the manager as well
    assert ts.residency.tier_of(w) == ts.residency.tiers[1]
    loss.backward()  # the saved w comes back on its own
    assert torch.allclose(w.grad, expected_w.grad)
    opt.step()  # the optimizer's reference is the same object
    assert torch.allclose(w.detach(), expected_w.detach() - 0.1 * expected_w.grad)


def test_no_offload_files_are_left_behind(tmp_path: os.PathLike[str]) -> None:
    ts.residency.configure(offload_dir=tmp_path)
    tensors = [ts.ref(torch.randn(1024)) for _ in range(5)]
    for t in tensors:
        t.demote()
    assert os.listdir(tmp_path) == []  # files have no names at all
    del tensors


def test_private_offload_dir_is_removed_when_the_manager_lets_it_go(
    tmp_path: os.PathLike[str],
) -> None:
    ts.residency.configure(offload_dir=None)
    t = ts.ref(torch.ones(256))
    t.demote()
    directory = ts.residency.disk.directory
    assert os.path.isdir(directory) and os.listdir(directory) == []
    t.promote()
    del t
    ts.residency.reset()
    ts.residency.configure(offload_dir=tmp_path)  # the private directory is not needed any more
    assert not os.path.exists(directory)


def test_unwritable_offload_dir_fails_at_configure(tmp_path: os.PathLike[str]) -> None:
    target = os.path.join(tmp_path, "file-not-dir")
    with open(target, "w") as handle:
        handle.write("x")
    with pytest.raises(ts.ResidencyError, match="offload"):
        ts.residency.configure(offload_dir=os.path.join(target, "sub"))


def test_changing_offload_dir_while_data_is_on_disk_is_refused(tmp_path: os.PathLike[str]) -> None:
    t = ts.ref(torch.ones(256))
    t.demote()
    with pytest.raises(ts.ResidencyError, match="offload_dir"):
        ts.residency.configure(offload_dir=tmp_path)
    assert t.tier == "disk" and t.sum().item() == 256


def test_a_truncated_offload_file_raises_and_the_ref_stays_on_disk() -> None:
    t = ts.ref(torch.ones(4096))
    t.demote()
    placement = ts.residency.placement_of(t)
    assert placement is not None and placement.region is not None
    os.ftruncate(placement.region.file.fd, 0)  # someone else truncated the file
    with pytest.raises(ts.ResidencyError, match="truncated"):
        t.promote()
    assert t.tier == "disk"
    with ts.scope(), pytest.raises(ts.ResidencyError, match="truncated"):
        t + 1  # an op needing it fails the same way (never a bus error)
    with pytest.warns(ts.ResidencyWarning, match="truncated"):
        ts.residency.reset()  # stops managing it: the lost bytes read as zeros


DISK_FULL_SCRIPT = r"""
import resource, signal, sys, torch, tensorscope as ts
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
ts.residency.configure(device="cpu", offload_dir=sys.argv[1])
t = ts.ref(torch.arange(1 << 20, dtype=torch.float32))  # 4 MiB
expected = t.clone()
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # files capped at 1 MiB
try:
    t.demote()
except ts.ResidencyError as error:
    print("ResidencyError:", error)
print("tier", t.tier, "intact", torch.equal(t, expected))
"""


def test_disk_full_raises_and_loses_nothing(tmp_path: os.PathLike[str]) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", DISK_FULL_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "ResidencyError: tensorscope.residency: the disk tier is full" in done.stdout
    assert "tier device intact True" in done.stdout


@pytest.mark.parametrize("budget", ["12 parsecs", 0, -5, "0MiB", "-3GiB", 1.5, "", "GiB"])
def test_invalid_budgets_are_rejected_naming_the_accepted_forms(budget: object) -> None:
    with pytest.raises((ValueError, TypeError), match=r"tensorscope\.residency") as info:
        ts.residency.configure(budget=budget)  # type: ignore[arg-type]
    assert isinstance(info.value, ts.TensorScopeError)
    assert "6GiB" in str(info.value) or "300MiB" in str(info.value)


@pytest.mark.parametrize(
    ("budget", "nbytes"), [("6GiB", 6 << 30), ("300MiB", 300 << 20), ("1.5GB", 1_500_000_000)]
)
def test_budget_forms(budget: str, nbytes: int) -> None:
    ts.residency.configure(budget=budget)
    assert ts.residency.budget_bytes == nbytes


def test_device_can_be_assigned_like_the_seed() -> None:
    ts.residency.device = "cpu"
    assert ts.residency.device == torch.device("cpu")
    with pytest.raises(ts.InvalidArgumentError):
        ts.residency.device = "tpu"


def test_a_dead_storages_offload_file_is_reused_by_the_next_of_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tensorscope.residency import disk

    tier = disk.DiskTier(None)
    try:
        first = torch.arange(2048, dtype=torch.float32)
        region = tier.store(first.data_ptr(), first.nbytes)
        assert tier.live_bytes == region.length and tier.pooled_bytes == 0
        tier.release(region, reusable=True)
        assert tier.pooled_bytes == region.length and tier.live_bytes == 0
        other_size = torch.ones(1024)
        assert tier.store(other_size.data_ptr(), other_size.nbytes) is not region
        second = torch.full((2048,), 7.0)
        again = tier.store(second.data_ptr(), second.nbytes)
        assert again is region and tier.pooled_bytes == 0  # same file, new bytes
        assert torch.equal(torch.empty(0).set_(region.storage()).view(torch.float32), second)
        # The pool never holds more than the live regions (or its small floor).
        monkeypatch.setattr(disk, "_POOL_MIN_BYTES", 0)
        tier.release(again, reusable=True)
        assert tier.pooled_bytes <= tier.live_bytes
    finally:
        tier.close()


def test_training_steps_reuse_the_gradients_offload_regions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tensorscope.residency import disk

    created: list[int] = []
    new_region = disk.DiskTier._region

    def counting(self: disk.DiskTier, nbytes: int) -> disk.DiskRegion:
        created.append(1)
        return new_region(self, nbytes)

    monkeypatch.setattr(disk.DiskTier, "_region", counting)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    ts.residency.configure(policy="flow", budget="96KiB")  # weights + grads + Adam: ~300 KiB
    handle = ts.manage(model)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 64)
    per_step = []
    for _ in range(6):
        before = len(created)
        with ts.scope():
            opt.zero_grad()  # grads die: new ones, of the same sizes, every step
            model(x).square().mean().backward()
            opt.step()
        per_step.append(len(created) - before)
    # The first steps carve regions (optimizer state, first grads); later grads reuse them.
    assert per_step[0] > 0 and sum(per_step[3:]) == 0, per_step
    assert ts.residency.report().peak_bytes <= 96 * 1024
    handle.remove()


@pytest.mark.strict
def test_empty_tensors_move_and_empty_parameters_are_managed() -> None:
    t = ts.ref(torch.ones(0))
    t.demote()
    assert t.tier == ts.residency.tiers[1] and t.shape == (0,)
    t.promote()
    assert t.tier == "device"
    model = torch.nn.Linear(64, 64)
    model.register_parameter("empty", torch.nn.Parameter(torch.empty(0, 64)))
    expected = model(torch.ones(2, 64))
    ts.residency.configure(budget="20KiB")  # the first weight (16 KiB) fits: the rest moves too
    handle = ts.manage(model)
    assert torch.equal(model(torch.ones(2, 64)), expected)
    handle.remove()
