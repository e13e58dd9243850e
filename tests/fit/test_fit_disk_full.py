"""A full disk under ts.fit (statestore.py NOTE [a full disk]): every write to the disk tier --
the optimizer state between updates, the probe that measures the tier, the files of the
activation offloader and of the chain's parameters -- that fails keeps what it was writing in
memory and warns; the step is decided again without that tier; training stays bit-identical to
plain; only where nothing fits without the tier does a ScheduleError say so, naming the
failure. The disk is made full by failing every write of a file region (``DiskRegion.write``,
the one ``pwrite`` path of the disk tier), and, in a child process, by a file size limit.
"""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tensorscope as ts
from tensorscope.errors import FitWarning, ResidencyError, ScheduleError
from tensorscope.fit.offload_rules import Bandwidth
from tensorscope.fit.parts import offload as offload_part
from tensorscope.fit.statestore import StateStore
from tensorscope.residency.mapping import DiskRegion

from .fit_helpers import batches, differing, optimizer, step, tight_state_budget, tiny, twin

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fill_disk(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Calling it makes every later write of the disk tier fail with ENOSPC."""

    def full(self: DiskRegion, address: int, fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return lambda: monkeypatch.setattr(DiskRegion, "write", full)


@pytest.fixture
def free_state_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Moving the optimizer state predicted free: with room for both, the decision moves it
    (the same schedule at a smaller peak), so a disk that fills later has state to refuse."""
    measured = StateStore.measure

    def free(self: StateStore, device: torch.device) -> Bandwidth | None:
        found = measured(self, device)
        return None if found is None else Bandwidth("disk", found.nbytes, math.inf, math.inf, 0.0)

    monkeypatch.setattr(StateStore, "measure", free)


def _state_devices(opt: torch.optim.Optimizer) -> set[str]:
    return {v.device.type for s in opt.state.values() for v in s.values()}


def test_a_full_disk_from_the_start_keeps_the_state_in_memory(
    fill_disk: Callable[[], None],
) -> None:
    fill_disk()
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget="1GiB")
    mine, theirs = batches("gpt2"), batches("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FitWarning)  # nothing failed that the plan needed
        for i in range(4):
            assert step(model, opt, next(mine), seed=i) == step(ref, ropt, next(theirs), seed=i)
    assert not differing(model, ref)
    assert fit.decision is not None
    assert not any(c.base.state_offloaded for c in fit.decision.candidates)
    assert _state_devices(opt) == {"cpu"}
    assert "the disk tier cannot be written" in fit.explain()
    fit.remove()


def test_a_full_disk_from_the_start_names_itself_when_nothing_fits_without_it(
    fill_disk: Callable[[], None],
) -> None:
    budget = tight_state_budget("gpt2", "adamw", None)
    fill_disk()
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    batch = next(batches("gpt2"))
    with pytest.raises(ScheduleError, match=r"with the optimizer state in memory .*disk tier"):
        step(model, opt, batch)  # raised by the step's optimizer.step(): the update ran
    step(ref, ropt, batch)
    assert not differing(model, ref)
    with pytest.raises(ScheduleError, match="disk tier"):
        step(model, opt, batch, seed=1)  # and again at the next training forward
    fit.remove()


@pytest.mark.usefixtures("free_state_moves")
@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_disk_that_fills_up_keeps_the_state_and_decides_again(
    fill_disk: Callable[[], None], clip: float | None
) -> None:
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget="1GiB")
    mine, theirs = batches("gpt2"), batches("gpt2")
    for i in range(7):
        if i == 3:
            assert fit.decision is not None and fit.decision.chosen.base.state_offloaded
            assert _state_devices(opt) == {"cpu", "meta"}
            fill_disk()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            mine_loss = step(model, opt, next(mine), seed=i, clip=clip)
        assert mine_loss == step(ref, ropt, next(theirs), seed=i, clip=clip)
        assert not differing(model, ref), f"step {i + 1}"
        failed = [w for w in seen if "could not be written" in str(w.message)]
        assert len(failed) == (i == 3), f"step {i + 1}: {[str(w.message) for w in seen]}"
    assert issubclass(failed[0].category, FitWarning) if failed else True
    decision = fit.decision
    assert decision is not None and not decision.chosen.base.state_offloaded
    assert _state_devices(opt) == {"cpu"}
    assert fit._states.store is not None and fit._states.store.write_errors >= 1
    assert any("writing the optimizer state to the disk tier failed" in n for n in fit.notes)
    assert fit.plan_after is not None and fit.measured_peak(fit.plan_after) <= fit.budget_bytes
    opt_state = opt.state_dict()["state"]
    for k, values in ropt.state_dict()["state"].items():
        for key, value in values.items():
            assert torch.equal(opt_state[k][key], value), (k, key)
    fit.remove()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_disk_that_fills_up_when_nothing_else_fits_raises_a_schedule_error(
    fill_disk: Callable[[], None], clip: float | None
) -> None:
    budget = tight_state_budget("gpt2", "adamw", clip)
    model = tiny("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    mine, theirs = batches("gpt2"), batches("gpt2")
    for i in range(3):
        step(model, opt, next(mine), seed=i, clip=clip)
        step(ref, ropt, next(theirs), seed=i, clip=clip)
    fill_disk()
    batch = next(mine)
    with (
        pytest.warns(FitWarning, match="could not be written"),
        pytest.raises(ScheduleError, match=r"optimizer state in memory .*No space left"),
    ):
        step(model, opt, batch, seed=3, clip=clip)
    opt.zero_grad()  # what the loop does after optimizer.step(), which raised
    step(ref, ropt, next(theirs), seed=3, clip=clip)
    assert not differing(model, ref)  # the step ran whole; nothing was lost
    assert _state_devices(opt) == {"cpu"}
    assert fit.decision is None and "no plan: " in fit.explain()
    with pytest.raises(ScheduleError):
        step(model, opt, next(mine), seed=4, clip=clip)
    fit.remove()
    for i in range(5, 7):  # plain again: the state is whole
        batch = next(theirs)
        assert step(model, opt, batch, seed=i, clip=clip) == step(
            ref, ropt, batch, seed=i, clip=clip
        )
    assert not differing(model, ref)


def test_an_offloader_whose_files_cannot_be_made_leaves_offload_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from .test_fit_offload_plan import _data, _fitted_and_plain
    from .test_fit_offload_plan import _step as offload_step

    def unwritable(*args: object, **kwargs: object) -> None:
        raise ResidencyError("tensorscope.residency: the disk tier is full (a test)")

    from .fit_helpers import offload_for_free

    offload_for_free(monkeypatch)
    monkeypatch.setattr(offload_part, "ActivationOffloader", unwritable)
    budget, model, plain, opt, plain_opt, fit = _fitted_and_plain()
    try:
        data = _data()
        for i in range(5):
            x = next(data)
            offload_step(model, opt, x, i)
            offload_step(plain, plain_opt, x, i)
            assert differing(model, plain) == [], f"step {i + 1}"
        assert fit.decision is not None and "offload" not in fit.decision.blocks
        assert "the disk tier cannot be written" in fit._offload.off
        assert fit.plan_after is not None and fit.measured_peak(fit.plan_after) <= budget
    finally:
        fit.remove()


# a real full disk: a file size limit of 0 bytes fails every write of the disk tier (EFBIG)
CHILD = """
import resource, signal, sys, tempfile
import torch
import tensorscope as ts
sys.path.insert(0, {repo!r})
from tensorscope.residency.disk import DiskTier
from tests.fit.fit_helpers import batches, differing, optimizer, step, tiny, twin

tempfile.gettempdir()  # found (a test file written) before the disk fills
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
model = tiny("gpt2")
ref = twin(model)
opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
fit = ts.fit(model, opt, budget=int(sys.argv[1]))
mine, theirs = batches("gpt2"), batches("gpt2")
for i in range(4):
    try:
        a = step(model, opt, next(mine), seed=i)
    except ts.ScheduleError as exc:
        print("ScheduleError", exc)
        break
    assert a == step(ref, ropt, next(theirs), seed=i)
moved = fit.decision and fit.decision.chosen.base.state_offloaded
print("equal", not differing(model, ref), "moved", moved)
fit.remove()
tempfile.tempdir = None  # looked for again: no directory can be written now
try:
    DiskTier(None)
except ts.ResidencyError as exc:
    print("a private directory:", exc)
"""


@pytest.mark.parametrize("tight", [False, True])
def test_a_file_size_limit_is_a_full_disk(tight: bool) -> None:
    budget = tight_state_budget("gpt2", "adamw", None) if tight else 1 << 30
    script = CHILD.format(repo=str(REPO))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(budget)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    if tight:
        assert "ScheduleError" in out and "the disk tier cannot be written" in out, out
        assert "File too large" in out, out
    else:
        assert "equal True moved False" in out, out + done.stderr[-2000:]
    assert "a private directory: tensorscope.residency: cannot create" in out, out
