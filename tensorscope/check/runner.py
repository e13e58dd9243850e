"""``tensorscope check``: the acceptance of the contract on this machine's best device.

Each check runs in a process of its own (worker.py) under a time limit: an exception or a failed
expectation in one is reported (with its traceback) and the others still run; a check that
runs out of time is killed and reported with what it had found so far. The table is printed,
and the JSON file (``--json``) is rewritten after every check, so that a run cut short still
leaves the checks done. The exit status is 0 only when every check passed.

This process runs no check itself and touches no GPU (``torch.cuda.is_available()`` at most,
for ``--device auto``): the workers do the work and report their environment.

Layer: the check package.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

__all__ = ["CHECKS", "CheckSpec", "resolve_device", "run_checks", "table"]


# The whole run at the acceptance shapes, unless told otherwise (API §12: at most 8 minutes).
FULL_RUN_S = 480.0

# Seconds a worker may take to start a check (import torch and tensorscope) before it counts
# as hung; a check's own time limit starts when it starts.
STARTUP_S = 180.0


@dataclass(frozen=True)
class CheckSpec:
    """A check: its name, what it checks, the function the worker calls, and its time limits
    in seconds (``full`` shapes, ``small`` shapes)."""

    name: str
    title: str
    target: str
    full_s: float
    small_s: float


# Cheapest first: a run cut short by its overall limit loses the costly ones only.
CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec(
        "scopes",
        "scopes give back every byte; a disposed tensor raises",
        "tensorscope.check.scopes:run",
        60,
        40,
    ),
    CheckSpec(
        "record",
        "ts.record's peak against the allocator's",
        "tensorscope.check.record:run",
        90,
        45,
    ),
    CheckSpec(
        "moves",
        "residency moves on real streams: round trips equal, memory back",
        "tensorscope.check.moves:run",
        90,
        40,
    ),
    CheckSpec(
        "managed",
        "a GPT-2 managed at 25% of its weights (Flow, Genoa)",
        "tensorscope.check.managed:run",
        200,
        60,
    ),
    CheckSpec(
        "fit",
        "ts.fit at HF checkpointing's peak and at 50% of plain",
        "tensorscope.check.fitcheck:run",
        240,
        90,
    ),
)


def run_checks(
    checks: Sequence[CheckSpec],
    device: str = "auto",
    size: str = "auto",
    json_path: str | None = None,
    time_limit_s: float | None = None,
    isolate: str = "auto",
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Run ``checks`` in order in worker processes; the report (also written to ``json_path``
    after each check).

    ``device="auto"``: CUDA when present, else the CPU. ``size="auto"``: full shapes on CUDA,
    small on the CPU. ``isolate``: ``"each"`` (a worker per check: fresh allocator baselines),
    ``"shared"`` (one worker runs them in turn, started again after a crash or a timeout: one
    import of torch and transformers instead of five), ``"auto"``: each on CUDA, shared on the
    CPU. ``time_limit_s``: for the whole run (default: ``FULL_RUN_S`` at full size, none at
    small)."""
    out = out or sys.stdout
    if device == "auto":
        device = resolve_device()
    if size == "auto":
        size = "small" if device == "cpu" else "full"
    if isolate == "auto":
        isolate = "shared" if device == "cpu" else "each"
    if time_limit_s is None and size == "full":
        time_limit_s = FULL_RUN_S
    report: dict[str, Any] = {
        "device": device,
        "size": size,
        "isolate": isolate,
        "environment": None,
        "checks": [],
        "passed": False,
    }
    started = time.perf_counter()

    def add(result: dict[str, Any]) -> None:
        if report["environment"] is None and result.get("environment"):
            report["environment"] = result["environment"]
        report["checks"].append(result)
        report["passed"] = all(c["status"] == "pass" for c in report["checks"])
        report["seconds"] = round(time.perf_counter() - started, 1)
        if json_path:
            _write_json(json_path, report)

    pending = list(checks)
    with tempfile.TemporaryDirectory(prefix="tensorscope-check-") as directory:
        while pending:
            group = pending if isolate == "shared" else pending[:1]
            done = _run_worker(group, device, size, directory, started, time_limit_s, out, add)
            pending = pending[done:]
    print(table(report), file=out, flush=True)
    return report


def _run_worker(
    group: Sequence[CheckSpec],
    device: str,
    size: str,
    directory: str,
    started: float,
    time_limit_s: float | None,
    out: TextIO,
    add: Any,
) -> int:
    """Run ``group`` in one worker, each check under its limit; how many got a result (the
    rest run in a new worker after a timeout or a crash)."""
    for spec in group:
        path = os.path.join(directory, f"{spec.name}.json")
        if os.path.exists(path):
            os.unlink(path)

    def left() -> float | None:
        if time_limit_s is None:
            return None
        return time_limit_s - (time.perf_counter() - started)

    remaining = left()
    if remaining is not None and remaining < 5:
        for spec in group:
            add(_result(spec, "timeout", 0.0, traceback="not started: the run's time limit"))
        return len(group)
    command = [
        sys.executable, "-m", "tensorscope.check.worker",
        "--checks", json.dumps([[s.name, s.title, s.target] for s in group]),
        "--device", device, "--size", size, "--out-dir", directory,
    ]  # fmt: skip
    tail: list[str] = []
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: killed whole on a timeout
    )
    reader = threading.Thread(target=_relay, args=(process, out, tail), daemon=True)
    reader.start()
    run_deadline = None if time_limit_s is None else started + time_limit_s
    try:
        for count, spec in enumerate(group):
            limit = spec.small_s if size == "small" else spec.full_s
            path = os.path.join(directory, f"{spec.name}.json")
            found, began = _wait(process, path, limit, run_deadline)
            seconds = round(time.perf_counter() - began, 1)
            status = str(found.pop("status", ""))
            found.pop("seconds", None)
            if status in ("pass", "fail", "error"):
                add(_result(spec, status, seconds, **found))
                continue
            if process.poll() is None:  # still running it (or still starting): out of time
                _kill(process)
                reader.join(timeout=10)
                if run_deadline is not None and time.perf_counter() >= run_deadline - 0.5:
                    why = f"killed after {seconds:.0f} s: the run's time limit"
                elif not status:
                    why = f"the worker did not start it within {STARTUP_S:.0f} s"
                else:
                    why = f"killed after {limit:.0f} s (its time limit)"
                found["traceback"] = why + "; its findings so far are above"
                add(_result(spec, "timeout", seconds, **found))
            else:
                reader.join(timeout=10)
                found["traceback"] = (
                    f"the worker ended with status {process.returncode} during this check (a "
                    "crash?); its last output:\n" + "".join(tail[-30:])
                )
                add(_result(spec, "error", seconds, **found))
            return count + 1
    finally:
        if process.poll() is None:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill(process)
        reader.join(timeout=10)
    return len(group)


def _wait(
    process: subprocess.Popen[str], path: str, limit: float, run_deadline: float | None
) -> tuple[dict[str, Any], float]:
    """The check's result once it is final, or what it found by the time the worker ended or
    its time ran out (``limit`` seconds from the moment the worker started it, at most
    ``STARTUP_S`` until then, never past ``run_deadline``); and when it started."""
    begin = time.perf_counter()
    began: float | None = None
    while True:
        found = _read(path)
        now = time.perf_counter()
        if found and began is None:
            began = now
        if found.get("status") in ("pass", "fail", "error"):
            return found, began or begin
        if process.poll() is not None:
            return _read(path), began or begin  # written just before it ended?
        deadline = began + limit if began is not None else begin + STARTUP_S
        if run_deadline is not None:
            deadline = min(deadline, run_deadline)
        if now >= deadline:
            return found, began or begin
        time.sleep(0.1)


def _result(spec: CheckSpec, status: str, seconds: float, **extra: Any) -> dict[str, Any]:
    found = {"name": spec.name, "title": spec.title, "status": status, "seconds": seconds}
    found["rows"] = []
    found["evidence"] = {}
    found.update(extra)
    found["status"] = status
    return found


def resolve_device() -> str:
    """CUDA when torch sees a GPU, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _relay(process: subprocess.Popen[str], out: TextIO, tail: list[str]) -> None:
    """Copy the worker's output to ours as it comes; keep its last lines."""
    assert process.stdout is not None
    for line in process.stdout:
        out.write(line)
        out.flush()
        tail.append(line)
        del tail[:-60]


def _kill(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as file:
            found: dict[str, Any] = json.load(file)
    except (OSError, ValueError):  # not written yet (the worker is starting)
        return {}
    return found


def _write_json(path: str, report: dict[str, Any]) -> None:
    partial = f"{path}.part"
    with open(partial, "w") as file:
        json.dump(report, file, indent=1)
    os.replace(partial, path)


def table(report: dict[str, Any]) -> str:
    """The report as text: one line per expectation, the evidence, tracebacks."""
    env = report.get("environment") or {}
    lines = [
        "",
        "tensorscope check: device "
        + str(report.get("device"))
        + (f" ({env['gpu']})" if env.get("gpu") else "")
        + ", "
        + ", ".join(f"{k} {v}" for k, v in env.items() if k != "gpu"),
    ]
    width = 72
    for check in report["checks"]:
        lines.append("")
        status, seconds = check["status"].upper(), check["seconds"]
        lines.append(f"[{status:7}] {check['name']}: {check['title']} ({seconds} s)")
        for row in check.get("rows", []):
            mark = "ok  " if row["ok"] else "FAIL"
            what = row["what"] if len(row["what"]) <= width else row["what"][: width - 3] + "..."
            lines.append(f"    {mark} {what}")
            lines.append(f"         measured {row['measured']}; expected {row['expected']}")
        for key, value in check.get("evidence", {}).items():
            lines.append(f"    . {key}: {_short(value)}")
        if check.get("traceback"):
            lines.extend("    ! " + line for line in str(check["traceback"]).rstrip().splitlines())
    verdict = "all checks passed" if report.get("passed") else "NOT all checks passed"
    failed = [c["name"] for c in report["checks"] if c["status"] != "pass"]
    lines.append("")
    lines.append(verdict + (f" (not passed: {', '.join(failed)})" if failed else ""))
    return "\n".join(lines)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 400 else text[:397] + "..."
