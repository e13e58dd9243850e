"""What the disk tier leaves behind: nothing after ``reset()``, and no stale private directory
after a process is killed (issue 15, items "reset() keeps the offload file open" and "SIGKILL
leaves an empty tensorscope-XXXX directory")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.residency import tempdirs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _held(directory: str) -> tuple[list[str], list[str]]:
    """This process's descriptors and mappings of files under ``directory``."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(directory):
            fds.append(target)
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if directory in line]
    return fds, mapped


def test_reset_releases_the_offload_files_and_mappings(tmp_path: Path) -> None:
    directory = str(tmp_path / "offload")
    ts.residency.configure(policy="flow", budget="96KiB", offload_dir=directory)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ts.manage(model)
    model[0].weight.demote()
    with ts.scope():
        model(torch.ones(2, 64)).sum().backward()
    fds, mapped = _held(directory)
    assert fds and mapped  # the offload files are open and mapped while managed
    ts.residency.reset()
    assert _held(directory) == ([], [])  # the directory could be unmounted now
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key])
    # The manager works on: a new move opens new files.
    t = ts.ref(torch.arange(1024.0))
    t.demote()
    assert t.tier == "disk" and _held(directory)[0]
    assert torch.equal(t + 0, torch.arange(1024.0))


def test_reset_removes_the_private_offload_dir() -> None:
    ts.residency.configure(offload_dir=None)
    t = ts.ref(torch.ones(1024))
    t.demote()
    directory = ts.residency.disk.directory
    assert os.path.basename(directory).startswith(f"tensorscope-{os.getpid()}-")
    ts.residency.reset()
    assert not os.path.exists(directory)
    assert _held(directory) == ([], [])
    assert t.tier == "device" and torch.equal(t, torch.ones(1024))


KILLED = r"""
import os, signal, torch, tensorscope as ts
ts.residency.configure(device="cpu", offload_dir=None)
t = ts.ref(torch.ones(1024))
t.demote()
print(ts.residency.disk.directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

HOLDER = r"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("tempdirs", sys.argv[1])
tempdirs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tempdirs)
print(tempdirs.PrivateDir().path, flush=True)
time.sleep(120)
"""


def test_private_dirs_of_killed_processes_are_removed_and_nothing_else(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    # A live process (its pid alive, its directory locked) that made its private directory.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, tempdirs.__file__],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None
        live = holder.stdout.readline().strip()
        assert os.path.isdir(live)
        killed = subprocess.run(
            [sys.executable, "-c", KILLED], capture_output=True, text=True, env=env, timeout=120
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        stale = killed.stdout.strip().splitlines()[-1]
        assert os.path.isdir(stale)  # SIGKILL ran no cleanup
        assert os.path.isdir(live)  # and the killed process left the live one alone
        # What is not ours to remove.
        not_ours = tmp_path / "tensorscope-999999999-abc"  # a dead pid, but a stranger's file
        not_ours.mkdir()
        (not_ours / "notes.txt").write_text("keep me")
        old_style = tmp_path / "tensorscope-k2j4h5g6"  # no pid: cannot tell it is stale
        old_style.mkdir()
        a_file = tmp_path / "tensorscope-999999998-f"
        a_file.write_text("")
        removed = tempdirs.clean_stale_dirs(str(tmp_path))
        assert removed == [os.path.basename(stale)]
        assert not os.path.exists(stale)
        assert os.path.isdir(live) and (not_ours / "notes.txt").exists()
        assert old_style.is_dir() and a_file.is_file()
    finally:
        holder.kill()
        holder.wait(30)
    # Once the holder is dead, its directory is stale too.
    assert tempdirs.clean_stale_dirs(str(tmp_path)) == [os.path.basename(live)]


def test_the_first_private_dir_of_a_process_cleans_its_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stale = tmp_path / "tensorscope-999999997-xyz"
    stale.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(tempdirs, "_cleaned", set())
    made = tempdirs.PrivateDir()
    try:
        assert not stale.exists()
        assert os.listdir(tmp_path) == [os.path.basename(made.path)]
    finally:
        made.remove()
    assert not os.path.exists(made.path)
