"""The test suite's rules, for every folder: where a new test goes, and what each test may assume.

Engines. tensorscope has two scope engines (the C++ one and the pure-Python one,
``TENSORSCOPE_ENGINE=python``) and CI runs the suite under both (``tox``, README's Contributing).
By default a test is **engine-dependent** and runs under both. A test that never reaches the
engines (a pure solver, a decision on numbers, the layer check, a script's ``--help``, the
docs) may be marked ``@pytest.mark.engine_independent`` (or ``pytestmark = ...`` for a whole
module): the Python-engine run deselects it (``-m "not engine_independent"``), so it runs once.
The mark is checked: a marked test that opens a scope, manages a module or creates a TensorRef
(in this process) fails and says to remove the mark. A test that starts a subprocess which uses
tensorscope must not be marked (the check cannot see inside the subprocess). Doctests (the
``tensorscope`` package's docstring examples) are marked here: they show the API once, and
what they show is tested under both engines by the unit tests.

Parallel runs. CI runs the suite in two pytest-xdist workers (``-n 2 --dist loadgroup``): each
test goes to whichever worker is free, except that the tests of one ``xdist_group`` run in one
worker, one after the other. Tests that start gloo process groups (a free port is picked, then
bound: two at once could race for it) take ``@pytest.mark.xdist_group("distributed")``. The
tests of a module that share a module- or class-scoped fixture are grouped here, so that the
fixture is made once, not once per worker.

``slow``: a test that takes more than ~5 s of CPU on a 2-core machine, even after making it as
small as what it checks allows. ``-m "not slow"`` gives a quick run while developing; CI runs
everything. ``--durations=25`` (CI) shows the slowest tests: the next one to make cheaper.

What every test gets (autouse fixtures, here): torch with one intra-op thread (tiny tensors on
a shared 2-core machine: two OpenMP threads spin-wait on each other, a 14-layer MLP's backward
took 0.5 s instead of 0.5 ms under load; plain and tensorscope runs use the same setting, so
bit-for-bit comparisons hold); no scope open before, and a failure if one is left open after;
a reset residency manager (CPU, Flow, no budget) before and after; no dispatch mode left pushed;
a watchdog that dumps every thread's stack and ends the run if a test hangs (a deadlocked
DataLoader worker or prefetch thread would otherwise hang the whole suite silently).

A run that executes no test fails (exit code 5), and the summary says which engine ran how
many tests.
"""

from __future__ import annotations

import faulthandler
import gc
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch

import tensorscope as ts
from tensorscope import _intercept
from tensorscope._engine import engine_name
from tensorscope._torch import scope_key_included

HANG_SECONDS = 240
ENGINE_INDEPENDENT = "engine_independent"

torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if isinstance(item, pytest.DoctestItem):
            item.add_marker(ENGINE_INDEPENDENT)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if _shares_a_module_fixture(item) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a module- or class-scoped fixture (made once for its tests)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(defs[-1].scope in ("module", "class") for defs in info.name2fixturedefs.values())


# ----------------------------------------------------------------------------- isolation
def reset_residency() -> None:
    """The residency manager as a fresh process has it: CPU, Flow, no budget, zero counters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reset() may warn about what a failed test left
        ts.residency.reset()
    ts.residency.configure(device="cpu", policy="flow", budget=None, offload_dir=None)
    ts.residency.report(reset=True)


def close_leftover_scopes(limit: int = 64) -> int:
    """Close the scopes still current in this thread, innermost first; return how many.

    Bounded (a closed scope still current fails instead of hanging), leak warnings silenced, and
    a close that raises (a test that failed badly) stops the loop instead of cascading.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for closed in range(limit):
            leftover = ts.current_scope()
            if leftover is None:
                return closed
            if leftover.is_closed:
                raise AssertionError(f"ts.current_scope() returned the closed scope {leftover!r}")
            try:
                leftover.close()
            except Exception:
                if ts.current_scope() is leftover:
                    return closed + 1
    raise AssertionError(f"still a scope open after closing {limit} scopes")


@pytest.fixture(autouse=True)
def _isolation() -> Iterator[None]:
    close_leftover_scopes()  # after a hard failure elsewhere: start clean, do not cascade
    reset_residency()
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    left_open = close_leftover_scopes()
    reset_residency()
    gc.collect()
    assert left_open == 0, f"the test left {left_open} scope(s) open"
    assert ts.current_scope() is None, "test left a scope open"
    assert torch._C._len_torch_dispatch_stack() == 0, "test left a dispatch mode pushed"
    assert not scope_key_included(), "test left the scope engines' key included"


# ------------------------------------------------------------------- engine-independent tests
@pytest.fixture(autouse=True)
def _engine_independent_check(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A test marked ``engine_independent`` runs under one engine only: it must not reach one.

    Scopes and ``ts.manage()`` reach the engines through ``_intercept.acquire``; refs created
    outside a scope show in this thread's counters.
    """
    if request.node.get_closest_marker(ENGINE_INDEPENDENT) is None:
        yield
        return
    acquired: list[object] = []
    acquire = _intercept.acquire

    def counting(*args: object, **kwargs: object) -> None:
        acquired.append(args)
        acquire(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_intercept, "acquire", counting)
    before = ts.stats()
    yield
    after = ts.stats()
    refs = (after.created_in_scope - before.created_in_scope) + (
        after.created_outside_scope - before.created_outside_scope
    )
    assert not acquired and refs == 0, (
        f"{request.node.nodeid} is marked {ENGINE_INDEPENDENT} (it runs under one engine only) "
        f"but it used a scope engine ({len(acquired)} scope/manage acquisitions, {refs} refs "
        "created): remove the mark, so that it runs under both engines"
    )


# ------------------------------------------------------------------------------- the report
class _Executed:
    """Tests that ran (passed or failed in their call phase; skips do not count)."""

    def __init__(self) -> None:
        self.count = 0
        self.independent = 0

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and report.failed):
            self.count += 1
            self.independent += ENGINE_INDEPENDENT in report.keywords


_EXECUTED = _Executed()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller of an xdist run, or a plain run
        config.pluginmanager.register(_EXECUTED, "tensorscope-executed")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or exitstatus != pytest.ExitCode.OK:
        return
    if _EXECUTED.count == 0:  # everything skipped or deselected: nothing was checked
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if hasattr(terminalreporter.config, "workerinput"):
        return
    terminalreporter.write_line(
        f"tensorscope: {_EXECUTED.count} tests executed under the {engine_name()} engine "
        f"({_EXECUTED.independent} of them engine-independent)"
        + ("; none executed: failing" if _EXECUTED.count == 0 else ""),
        bold=True,
    )
