"""The test suite's rules, for every folder: where a new test goes, and what each test may assume.

Engines. tensorscope has two scope engines (the C++ one and the pure-Python one,
``TENSORSCOPE_ENGINE=python``) and CI runs the suite under both (``tox``, README's Contributing).
By default a test is **engine-dependent** and runs under both. A test that never reaches the
engines (a pure solver, a decision on numbers, rotor, ``ts.fit`` outside scopes, the layer
check, a script's ``--help``, the docs) may be marked ``@pytest.mark.engine_independent`` (or
``pytestmark = ...`` for a whole module): the Python-engine run deselects it (``-m "not
engine_independent or engine_dependent"``), so it runs once. In a module marked so, a test that
does reach an engine takes ``@pytest.mark.engine_dependent``, which wins. The mark is checked:
a test counted independent that opens a scope, manages a module or creates a TensorRef (in this
process) fails and says what to do. The check cannot see inside a subprocess: a test whose
subprocess uses scopes or ``ts.manage()`` must not be counted independent, unless the
subprocess chooses its engine itself (``TENSORSCOPE_ENGINE``). Doctests (the ``tensorscope``
package's docstring examples) are marked here: they show the API once, and what they show is
tested under both engines by the unit tests.

Parallel runs. CI runs the suite in two pytest-xdist workers, file by file (``-n 2 --dist
loadfile``: the tests of one module run in one worker, so a module-scoped fixture is made once).
Tests that must never run at the same time as each other, in any worker, share a
``@pytest.mark.serial(name)``: a file lock held for the test. Tests that start gloo process
groups take ``serial("distributed")`` (a free port is picked, then bound: two at once could
race for it). (``xdist_group`` with ``--dist loadgroup`` would say the same, but pytest 9.2
changed node ids under it and pytest-xdist 3.8 no longer groups: pytest-xdist issue 1386.)

Backends. What differs per device lives in a backend (``tensorscope/residency/backends``): the
CPU's (moves map and drop pages of the offload files) unless ``TENSORSCOPE_BACKEND=strict``
chooses the strict backend, which runs the CUDA backend's copy paths on the CPU with late
copies (a copy's destination holds poison until it is waited: base.py's NOTE [the copy rules],
strict.py's NOTE [late copies]). CI runs the tests that move data through a backend a second
time under it, with the C++ engine: they are marked ``@pytest.mark.strict`` (a test, or a
module's ``pytestmark``), and under the variable every other test is deselected. A test in a
module marked so that checks what only the CPU backend does (file mappings, page-cache
behaviour, the disk tier right below the device) takes ``@pytest.mark.cpu_backend``, which
wins. Write the tier a demotion goes to as ``ts.residency.tiers[1]`` ("disk" below the CPU,
"host" below CUDA and the strict backend), not ``"disk"``, in a test marked strict.

``slow``: a test whose call takes more than ``SLOW_CPU_SECONDS`` of CPU (its process and the
subprocesses it waited for), even after making it as small as what it checks allows. ``-m "not
slow"`` gives a quick run while developing; CI runs everything. CPU time, unlike wall time, does
not grow when other work shares the machine: the summary lists the tests over that mark that
are not marked ``slow`` (the next ones to make cheaper, or to mark), and ``--durations=25`` (CI)
shows the slowest by wall time.

What every test gets (autouse fixtures, here): torch with one intra-op thread (tiny tensors on
a shared 2-core machine: two OpenMP threads spin-wait on each other, a 14-layer MLP's backward
took 0.5 s instead of 0.5 ms under load; plain and tensorscope runs use the same setting, so
bit-for-bit comparisons hold); no scope open before, and a failure if one is left open after;
a reset residency manager (CPU, Flow, no budget) before and after; a garbage collection after,
on a frozen heap (NOTE [a frozen heap] below); no dispatch mode left pushed; a watchdog that
dumps every thread's stack and ends the run if a test hangs (a deadlocked DataLoader worker or
prefetch thread would otherwise hang the whole suite silently).

A run that executes no test fails (exit code 5), and the summary says which engine ran how
many tests.
"""

from __future__ import annotations

import faulthandler
import fcntl
import gc
import os
import resource
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import tensorscope as ts
from tensorscope import _intercept
from tensorscope._engine import engine_name
from tensorscope._torch import scope_key_included

HANG_SECONDS = 240
SLOW_CPU_SECONDS = 5.0
ENGINE_INDEPENDENT = "engine_independent"
ENGINE_DEPENDENT = "engine_dependent"  # wins over a module's engine_independent

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if isinstance(item, pytest.DoctestItem):
            item.add_marker(ENGINE_INDEPENDENT)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
    if os.environ.get("TENSORSCOPE_BACKEND", "").strip().lower() == "strict":
        kept = [i for i in items if "strict" in i.keywords and "cpu_backend" not in i.keywords]
        if len(kept) < len(items):
            keep = {id(i) for i in kept}
            config.hook.pytest_deselected(items=[i for i in items if id(i) not in keep])
            items[:] = kept


# ----------------------------------------------------------------------------- isolation
# NOTE [a frozen heap]
# Every test ends with ``gc.collect()`` (a finalizer that closes a scope or removes a hook must
# run before the checks below), and some fixtures collect too. Once torch, transformers and the
# whole suite are imported, a full collection walks ~400k objects: ~0.1-0.2 s, more than many
# tests take, paid ~1200 times per engine. So what is alive after collection, and what is still
# alive after each test's collection, is frozen (``gc.freeze()``): later collections walk only
# the objects made since, and find all the garbage a test made. A cycle of objects that were
# all alive at some test's end and die later is never collected: memory, not behaviour.
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


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
    gc.freeze()  # see the NOTE above
    assert left_open == 0, f"the test left {left_open} scope(s) open"
    assert ts.current_scope() is None, "test left a scope open"
    assert torch._C._len_torch_dispatch_stack() == 0, "test left a dispatch mode pushed"
    assert not scope_key_included(), "test left the scope engines' key included"


@pytest.fixture(autouse=True)
def _decisions_not_timed_against_load() -> Iterator[None]:
    """ts.fit sets its predicted step time against two measured steps once and decides again
    when they are far apart (fit/handle.py, NOTE [a prediction measured against]); on a loaded
    test machine that makes a decision depend on the load. Tests that check a decision keep
    the one they got; tests/fit/test_fit_retime.py checks the rule itself. Its own
    MonkeyPatch: asking for the test's would set that up before the fixtures below, and undo
    the test's patches only after their teardown (see _engine_independent_check)."""
    from tensorscope.fit import handle

    patch = pytest.MonkeyPatch()
    patch.setattr(handle, "TIME_TOLERANCE", float("inf"))
    yield
    patch.undo()


@pytest.fixture
def free_replays() -> Iterator[None]:
    """Blocks kept selectively (NOTE [selective recomputation], checkpoint/simulate.py) with
    their replays priced at no time: rotor's DP then runs a block as Fs wherever memory is short,
    whatever this machine's timings (else a re-timed step may find recomputing as fast, and a
    test of Fs would test nothing). For tests/checkpoint and tests/fit alike."""
    import dataclasses

    from tensorscope.checkpoint.profile import Profile

    to_chain = Profile.to_chain

    def free(self: Profile, loss_tmp: int = 0) -> Any:
        chain = to_chain(self, loss_tmp)
        return dataclasses.replace(chain, sel_bw=(0.0,) * chain.length)

    patch = pytest.MonkeyPatch()
    patch.setattr(Profile, "to_chain", free)
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _serial(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests of one ``serial`` name run one at a time across the workers of a run."""
    mark = request.node.get_closest_marker("serial")
    if mark is None:
        yield
        return
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    path = os.path.join(tempfile.gettempdir(), f"tensorscope-tests-{run}-{mark.args[0]}.lock")
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ------------------------------------------------------------------- engine-independent tests
def _independent(keywords: Mapping[str, object]) -> bool:
    return ENGINE_INDEPENDENT in keywords and ENGINE_DEPENDENT not in keywords


@pytest.fixture(autouse=True)
def _engine_independent_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test marked ``engine_independent`` runs under one engine only: it must not reach one.

    Scopes and ``ts.manage()`` reach the engines through ``_intercept.acquire``; refs created
    outside a scope show in this thread's counters. Its own MonkeyPatch, not the test's: the
    test's is undone only after every autouse fixture's teardown (the residency reset ran with
    a test's patches still on).
    """
    if not _independent(request.node.keywords):
        yield
        return
    acquired: list[object] = []
    acquire = _intercept.acquire

    def counting(*args: object, **kwargs: object) -> None:
        acquired.append(args)
        acquire(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_intercept, "acquire", counting)
        before = ts.stats()
        yield
        after = ts.stats()
    refs = (after.created_in_scope - before.created_in_scope) + (
        after.created_outside_scope - before.created_outside_scope
    )
    assert not acquired and refs == 0, (
        f"{request.node.nodeid} is marked {ENGINE_INDEPENDENT} (it runs under one engine only) "
        f"but it used a scope engine ({len(acquired)} scope/manage acquisitions, {refs} refs "
        f"created): remove the mark, or mark this test {ENGINE_DEPENDENT}, so that it runs "
        "under both engines"
    )


# ------------------------------------------------------------------------------- the report
def _cpu_seconds() -> float:
    """CPU time of this process and of the subprocesses it has waited for."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_seconds", round(_cpu_seconds() - start, 3)))


class _Executed:
    """Tests that ran (passed or failed in their call phase; skips do not count), and the ones
    over ``SLOW_CPU_SECONDS`` that are not marked slow."""

    def __init__(self) -> None:
        self.count = 0
        self.independent = 0
        self.unmarked_slow: list[tuple[float, str]] = []

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and report.failed):
            self.count += 1
            self.independent += _independent(report.keywords)
        cpu = dict(report.user_properties).get("cpu_seconds")
        if not isinstance(cpu, float) or report.when != "call" or "slow" in report.keywords:
            return
        if cpu > SLOW_CPU_SECONDS:
            self.unmarked_slow.append((cpu, report.nodeid))


_EXECUTED = _Executed()


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller of an xdist run, or a plain run
        config.pluginmanager.register(_EXECUTED, "tensorscope-executed")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput") or exitstatus != pytest.ExitCode.OK:
        return
    if session.config.option.collectonly:
        return
    if _EXECUTED.count == 0:  # everything skipped or deselected: nothing was checked
        session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if (
        hasattr(terminalreporter.config, "workerinput")
        or terminalreporter.config.option.collectonly
    ):
        return
    if _EXECUTED.unmarked_slow:
        terminalreporter.section(f"over {SLOW_CPU_SECONDS:g} s of CPU, not marked slow")
        for cpu, nodeid in sorted(_EXECUTED.unmarked_slow, reverse=True):
            terminalreporter.write_line(f"{cpu:7.1f} s CPU  {nodeid}")
    terminalreporter.write_line(
        f"tensorscope: {_EXECUTED.count} tests executed under the {engine_name()} engine "
        f"({_EXECUTED.independent} of them engine-independent)"
        + ("; none executed: failing" if _EXECUTED.count == 0 else ""),
        bold=True,
    )
