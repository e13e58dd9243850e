"""``tensorscope check``'s runner: each check isolated, every outcome reported, the run goes on."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tensorscope.check.cli import main
from tensorscope.check.runner import CheckSpec, run_checks


def _spec(name: str, limit: float = 60) -> CheckSpec:
    return CheckSpec(name, f"the {name} check", f"tests.check._fakes:{name}", limit, limit)


@pytest.mark.parametrize("isolate", ["shared", "each"])
def test_every_outcome_is_reported_and_the_run_goes_on(isolate: str, tmp_path: Path) -> None:
    specs = [
        _spec("passes"),
        _spec("fails"),
        _spec("raises"),
        _spec("hangs", limit=4),
        _spec("crashes"),
        _spec("finds_nothing"),
        _spec("passes"),
    ]
    if isolate == "each":  # a worker per check: one killed, the next one runs
        specs = [specs[3], specs[0]]
    out = io.StringIO()
    report = run_checks(specs, "cpu", "small", str(tmp_path / "r.json"), None, isolate, out)
    statuses = [c["status"] for c in report["checks"]]
    expected = ["pass", "fail", "error", "timeout", "error", "error", "pass"]
    assert statuses == (expected if isolate == "shared" else ["timeout", "pass"])
    assert not report["passed"]
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["hangs"]["rows"][0]["what"] == "found before hanging"  # kept when killed
    assert "killed after 4 s" in by_name["hangs"]["traceback"]
    assert by_name["hangs"]["seconds"] < 30
    if isolate == "shared":
        assert "ValueError: a check's own bug" in by_name["raises"]["traceback"]
        assert [r["what"] for r in by_name["raises"]["rows"]] == ["before the error"]
        assert "status 3" in by_name["crashes"]["traceback"]
        assert "no expectation" in by_name["finds_nothing"]["traceback"]
        assert [r["ok"] for r in by_name["fails"]["rows"]] == [False, True]
    written = json.loads((tmp_path / "r.json").read_text())
    assert [c["status"] for c in written["checks"]] == statuses
    assert written["environment"]["engine"] in ("c++", "python")
    text = out.getvalue()
    assert "NOT all checks passed" in text
    assert ("FAIL a finding that does not hold" in text) == (isolate == "shared")


def test_the_run_time_limit_reports_checks_not_started(tmp_path: Path) -> None:
    out = io.StringIO()
    report = run_checks([_spec("hangs"), _spec("passes")], "cpu", "small", None, 6, "shared", out)
    assert [c["status"] for c in report["checks"]] == ["timeout", "timeout"]
    assert "the run's time limit" in report["checks"][0]["traceback"]
    assert "not started" in report["checks"][1]["traceback"]


def test_the_command_line_rejects_unknown_checks() -> None:
    with pytest.raises(SystemExit):
        main(["--only", "nonsense"])
    with pytest.raises(SystemExit):
        main(["--device", "tpu"])


def test_cuda_asked_for_without_a_gpu_runs_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["--device", "cuda"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
