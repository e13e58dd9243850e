"""``tensorscope check`` on the CPU, as a user runs it: every check passes, small and quick."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tensorscope

ROOT = Path(tensorscope.__file__).parent.parent


def test_check_passes_on_the_cpu(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tensorscope.check", "--device", "cpu", "--json",
         str(tmp_path / "check.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "check.json").read_text())
    assert [c["name"] for c in report["checks"]] == ["scopes", "record", "moves", "managed", "fit"]
    assert all(c["status"] == "pass" and c["rows"] for c in report["checks"])
    assert report["device"] == "cpu" and report["size"] == "small"
    assert "all checks passed" in result.stdout
    rows = {row["what"] for c in report["checks"] for row in c["rows"]}
    assert "use after dispose: h + 1" in rows
    assert any(what.startswith("flow: logits") for what in rows)
