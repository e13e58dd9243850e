"""Every benchmark and example answers ``--help`` (a user's first call): argparse formats each
help string with ``%``, and a bare ``%`` in one crashed the whole help of managed_overhead.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p
    for folder in ("benchmarks", "examples")
    for p in (ROOT / folder).glob("*.py")
    if not p.name.startswith("_") and "argparse" in p.read_text()
)


def test_there_are_scripts_to_check() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_help_is_printed(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
