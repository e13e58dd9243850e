"""The command line and the demo's workloads (small, in-process; the full demo is the main job)."""

from __future__ import annotations

import sys

import pytest

from tensorscope import cli, demo


def test_cli_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        cli.main(["demo", "--batches", "0"])
    with pytest.raises(SystemExit):
        cli.main(["nonsense"])


def test_leak_variants_keep_what_they_say() -> None:
    plain = demo.run_leak_variant("plain", 2, show_progress=False)
    scoped = demo.run_leak_variant("scoped", 2, show_progress=False)
    kept = demo.run_leak_variant("scoped-fixed", 2, show_progress=False)
    assert (plain.kept, scoped.kept, kept.kept) == (2, 0, 2)
    assert scoped.leak_report and "held by a list" in scoped.leak_report[0]
    assert "demo.py:" in scoped.leak_report[0]  # the demo's own line, as for user code


def test_progress_in_a_log_is_one_line_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    """Captured stderr is not a terminal (as in CI or ``| tee``): no tqdm carriage returns."""
    assert not sys.stderr.isatty()
    demo.run_leak_variant("plain", 3, show_progress=True)
    demo.run_leak_variant("scoped", 2, show_progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("  plain: 3/3 batches, ") and lines[0].endswith(" s")
    assert lines[1].startswith("  scoped: 2/2 batches, ")


def test_no_progress_when_not_asked(capsys: pytest.CaptureFixture[str]) -> None:
    demo.run_leak_variant("plain", 2, show_progress=False)
    assert capsys.readouterr().err == ""


def test_times_of_a_loaded_machine_are_called_unreliable() -> None:
    assert demo._load_note([0.3, 1.9, 2.0], cores=2) is None  # a core per runnable thread
    note = demo._load_note([0.3, 5.62, 2.0], cores=2)
    assert note is not None
    assert "load average up to 5.6 on 2 cores" in note and "unreliable" in note
    assert demo._load_note([], cores=1) is None


def _fake_run(call: str) -> dict[str, object]:
    """What a variant's subprocess returns, without running it (only the tables are tested)."""
    variant = call.split("'")[1]
    if call.startswith("run_leak_variant"):
        return {"variant": variant, "batches": 2, "peak_above_baseline_bytes": 2**20,
                "seconds": 0.5, "kept": 2, "leak_report": []}  # fmt: skip
    return {"variant": variant, "weight_bytes": 2**29, "seconds_per_forward": 12.3,
            "peak_above_baseline_bytes": 2**27, "output_checksum": [1.0, 2.0, 3.0],
            "report": ""}  # fmt: skip


@pytest.mark.parametrize("load", [1.5, 5.0])
def test_each_table_says_when_its_times_are_unreliable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], load: float
) -> None:
    monkeypatch.setattr(demo, "_run_in_subprocess", _fake_run)
    monkeypatch.setattr(demo, "_load_average", lambda: load)
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    assert demo.main(batches=2, forwards=1) == 0
    out = capsys.readouterr().out
    assert "ts.scope() + detach_from_scope()" in out and "ts.manage, genoa" in out
    notes = [line for line in out.splitlines() if "times and their ratios are unreliable" in line]
    assert len(notes) == (2 if load > 2 else 0)  # one under each table
