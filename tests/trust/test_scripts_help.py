"""Every benchmark and example answers ``--help`` (a user's first call): argparse formats each
help string with ``%``, and a bare ``%`` in one crashed the whole help of managed_overhead.py.
A script's progress in a log (CI, ``| tee``) is a line, not a bar's carriage returns.

# NOTE [one interpreter for every script's --help]
# Each script runs as ``python script.py --help`` would run it (``runpy``, ``__name__ ==
# "__main__"``, ``sys.argv[0]`` the script, its folder first on ``sys.path``), all in one
# subprocess: the scripts import torch (some transformers) at module level, and eleven
# interpreters importing it cost ~40 s of CPU for a few lines of help each. A script's own
# output and exit status are captured one by one, so a failure names its script.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.engine_independent  # --help stops before any tensorscope work

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p
    for folder in ("benchmarks", "examples")
    for p in (ROOT / folder).glob("*.py")
    if not p.name.startswith("_") and "argparse" in p.read_text()
)

RUN_ALL = r"""
import contextlib, io, json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [path, "--help"]
    sys.path.insert(0, path.rsplit("/", 1)[0])
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
            status = 0
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except BaseException:
            traceback.print_exc()
            status = 1
    sys.path.pop(0)
    results[path] = [status, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, Any]:
    """``[exit status, stdout, stderr]`` of ``script --help``, for every script."""
    done = subprocess.run(
        [sys.executable, "-c", RUN_ALL, *(str(p) for p in SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


def test_there_are_scripts_to_check() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_help_is_printed(script: Path, helps: dict[str, Any]) -> None:
    status, out, err = helps[str(script)]
    assert status == 0, err[-2000:]
    assert "usage:" in out
    assert f"usage: {script.name}" in out  # the script's own parser, not another's


def test_a_checkpoint_written_into_a_log_reports_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its _offload_common, as when run
    spec = importlib.util.spec_from_file_location(
        "bigger_than_ram", ROOT / "benchmarks" / "bigger_than_ram.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bigger_than_ram", bench)  # its dataclasses look it up
    spec.loader.exec_module(bench)
    plan = bench.plan_checkpoint(bench.TINY_CONFIG, shard_bytes=64 * 1024)
    assert len(plan.shards) > 3
    bench.write_checkpoint(tmp_path, plan, seed=0, progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [err.strip()], err  # one line
    assert err.startswith(f"wrote the checkpoint: {len(plan.shards)} shards, ")
    assert (tmp_path / bench.MARKER).exists()
