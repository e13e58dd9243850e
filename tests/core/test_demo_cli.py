"""The command line and the demo's workloads (small, in-process; the full demo is the main job)."""

from __future__ import annotations

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
