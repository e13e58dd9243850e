"""Lifecycle: what manage() changes and gives back, and what is left after the process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import tensorscope as ts


def test_manage_needs_a_module_on_the_managers_device() -> None:
    with pytest.raises(ts.ArgumentTypeError, match=r"nn\.Module"):
        ts.manage(torch.ones(3))  # type: ignore[arg-type]


@pytest.mark.strict
def test_manage_keeps_parameters_parameters_and_remove_restores_them() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ts.residency.configure(policy="genoa", budget="4KiB")
    handle = ts.manage(model)
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert isinstance(model[0].weight, ts.ManagedParameter)
    model[0].weight.demote()
    below = ts.residency.tiers[1]  # "disk" below the CPU
    assert model[0].weight.tier == below and model[1].running_mean.tier == "device"
    assert list(model.state_dict()) == list(before)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    handle.remove()
    handle.remove()  # idempotent
    assert type(model[0].weight) is nn.Parameter and type(model[1].running_mean) is torch.Tensor
    assert ts.residency.managed_count() == 0


def test_managed_module_as_a_context_manager_and_repr() -> None:
    model = nn.Linear(4, 4)
    with ts.manage(model) as handle:
        assert "ManagedModule Linear" in repr(handle)
        assert repr(model.weight).startswith("Parameter containing:")
    assert handle.removed and type(model.weight) is nn.Parameter


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's shared file mappings (Linux /proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[1][3] == "s" and fields[4] != "0":
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_manage_on_cpu_moves_every_weight_into_a_file_mapping_resident_or_not() -> None:
    # The weights kept resident move too, so that their heap memory is released at manage()
    # rather than during the first forward; later moves only map and drop pages.
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ts.residency.configure(policy="flow", budget="600KiB")  # two of the three weights fit
    handle = ts.manage(model)
    tiers = [layer.weight.tier for layer in model]
    assert tiers.count("device") == 2 and tiers.count("disk") == 1
    mappings = _file_mappings()
    for param in model.parameters():
        address = param.untyped_storage().data_ptr()
        assert any(start <= address < end for start, end in mappings), param.shape
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    out = model(torch.ones(2, 256))
    handle.remove()
    assert torch.equal(out, model(torch.ones(2, 256)))
    mappings = _file_mappings()  # remove() gives ordinary memory back
    for param in model.parameters():
        address = param.untyped_storage().data_ptr()
        assert not any(start <= address < end for start, end in mappings)


EXIT_SCRIPT = r"""
import torch, tensorscope as ts
t = ts.ref(torch.ones(1024))
t.demote()
print(ts.residency.disk.directory, flush=True)
"""


def test_the_private_offload_dir_is_gone_after_the_process_exits() -> None:
    import os

    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    directory = done.stdout.strip().splitlines()[-1]
    assert directory and not os.path.exists(directory)


@pytest.mark.gpu
def test_cuda_round_trip_through_host_and_disk() -> None:
    ts.residency.configure(device="cuda", policy="flow", budget="64MiB")
    t = ts.ref(torch.arange(1 << 20, dtype=torch.float32, device="cuda"))
    expected = t.clone()
    t.demote("host")
    assert t.tier == "host"
    t.demote("disk")
    assert t.tier == "disk"
    t.promote()
    assert t.tier == "device" and torch.equal(t, expected)


@pytest.mark.gpu
def test_cuda_training_under_budget_matches_plain() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).cuda()
    reference = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).cuda()
    reference.load_state_dict(model.state_dict())
    ts.residency.configure(device="cuda", policy="flow", budget="2MiB")
    handle = ts.manage(model)
    opt, ref_opt = torch.optim.Adam(model.parameters()), torch.optim.Adam(reference.parameters())
    x = torch.randn(32, 256, device="cuda")
    for _ in range(3):
        with ts.scope():
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        ref_loss = reference(x).pow(2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
    handle.remove()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(ours, theirs)
