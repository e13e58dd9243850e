"""``tensorscope plan script.py``: a script's step planned without changing the script."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tensorscope import cli

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters())
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 50

    def step():
        x = torch.randn(16, 32)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    if __name__ == "__main__":
        for _ in range(steps):
            step()
        print("the script finished")
    """
)


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    return path


def test_plan_a_script_writes_the_picture_and_the_summary(
    script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", str(script), "--snapshot", "step.pickle"]) == 0
    out = capsys.readouterr().out
    assert "recorded optimizer step 2 of" in out
    assert "tensorscope plan: peak" in out and "optimizer_state" in out
    assert "the script finished" not in out  # stopped after the recorded step
    assert (script.parent / "step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (script.parent / "step.pickle").stat().st_size > 0


def test_a_short_script_is_planned_from_its_last_step(
    script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", str(script), "--out", "one.png", "--", "1"]) == 0
    out = capsys.readouterr().out
    assert "recorded optimizer step 1 of" in out and "the script finished" in out
    assert (script.parent / "one.png").exists()


def test_plan_a_step_function(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", str(script), "--step", "train:step", "--out", "f.png"]) == 0
    out = capsys.readouterr().out
    assert "recorded one call of train:step" in out
    assert "the script finished" not in out  # run as a module: its main block did not run
    assert (script.parent / "f.png").exists()


def test_bad_arguments(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "missing.py"]) == 1
    assert "no script at 'missing.py'" in capsys.readouterr().err
    assert cli.main(["plan", str(script), "--step", "train"]) == 1
    assert "module:function" in capsys.readouterr().err
    assert cli.main(["plan", str(script), "--step", "train:nothing"]) == 1
    with pytest.raises(SystemExit):
        cli.main(["plan"])
    no_step = script.parent / "idle.py"
    no_step.write_text("import torch\nprint(torch.ones(3).sum())\n")
    assert cli.main(["plan", str(no_step)]) == 1
    assert "completed no optimizer.step()" in capsys.readouterr().err


def test_the_command_line_entry_point(script: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tensorscope.cli", "plan", str(script), "--out", "cli.png"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
    )
    assert done.returncode == 0, done.stderr
    assert "largest tensors alive at the peak" in done.stdout
    assert (script.parent / "cli.png").exists()
