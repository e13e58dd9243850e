"""docs/api.md §8: a moved tensor keeps its graph; the two engines behave the same.

The cases live in ``graph_cases.py``: here each runs in this process (checked against plain
PyTorch), and the whole set runs under each engine in a fresh process, whose results must be
identical (values, errors, ``len(scope)`` and ``ts.stats()``).
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

import tensorscope as ts
from tests.scope.graph_cases import CASES

CASES_FILE = Path(__file__).with_name("graph_cases.py")
ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("moved[")])
def test_a_moved_loss_backpropagates_like_plain(name: str) -> None:
    result = CASES[name]()
    assert result["input_disposed"]
    assert result["grad"] == result["plain_grad"]
    stats = result["stats"]
    assert stats["live"] == 0  # everything made in the scopes is disposed once the loss goes


def test_a_scoped_loss_helper_trains_like_plain() -> None:
    assert CASES["scoped_loss_helper"]()["equal_to_plain"]


def test_a_disposed_ref_used_directly_raises() -> None:
    result = CASES["disposed_use_raises"]()
    assert result["h+1"] == result["h.sum()"] == result["grad wrt h"] == "DisposedTensorError"
    assert len(result["grad wrt w"]) == 8


def test_retain_graph_and_a_second_backward() -> None:
    result = CASES["retain_graph_then_dispose"]()
    assert result["second"] == pytest.approx([2 * v for v in result["first"]], abs=1e-4)
    assert result["third"] == "RuntimeError"  # PyTorch's "backward through the graph a second time"
    assert result["after_dispose"]


def test_disposing_a_saved_input_by_hand_keeps_the_live_graph_whole() -> None:
    result = CASES["disposed_by_hand_then_backward"]()
    assert result["grad"] == result["plain"]


def test_a_scoped_generator_yields_losses_that_keep_their_graphs() -> None:
    result = CASES["generator_yields_keep_graphs"]()
    assert len(result["grad"]) == 3


def test_a_moved_graph_keeps_a_leaf_that_autocast_cached() -> None:
    result = CASES["autocast_leaf_moved"]()
    assert result["w_disposed"] and result["grad"] == result["plain"]


def test_a_transformers_step_through_a_scoped_helper_leaves_nothing_alive() -> None:
    result = CASES["transformers_scoped_step_and_generate"]()
    assert result["grads"] > 0
    assert result["step_stats"]["live"] == 0
    assert result["generate_stats"]["live"] == 0 and result["generate_owned"] > 0
    assert len(result["tokens"][0]) == 8


def test_graphs_keep_what_python_objects_of_theirs_hold() -> None:
    for kind, result in CASES["graph_held_through_python_objects"]().items():
        assert result["grad"] == result["plain"], kind


def test_llama_gradient_checkpointing_through_a_scoped_helper() -> None:
    for kind, result in CASES["llama_checkpointing_through_a_scoped_helper"]().items():
        assert result["scoped"] == result["plain"] > 0, kind


def _run_cases(engine: str) -> dict[str, object]:
    env = dict(os.environ, TENSORSCOPE_ENGINE=engine, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(CASES_FILE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.slow  # two interpreters run every case
@pytest.mark.engine_independent  # its subprocesses choose their engines themselves
def test_both_engines_give_the_same_results_errors_counts_and_stats() -> None:
    cpp = _run_cases("c++")
    python = _run_cases("python")
    assert cpp["engine"] == "c++", "the C++ engine was not built (pip install -e . builds it)"
    assert python["engine"] == "python"
    assert isinstance(cpp["cases"], dict) and isinstance(python["cases"], dict)
    different = {
        name: (cpp["cases"][name], python["cases"].get(name))
        for name in cpp["cases"]
        if cpp["cases"][name] != python["cases"].get(name)
    }
    assert not different, different
    assert all("raised" not in result for result in cpp["cases"].values()), cpp["cases"]


# ------------------------------------------------------------------------------------ memory
MiB = 2**20


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def test_a_moved_graph_holds_its_saved_tensors_until_backward_even_with_stray_handles() -> None:
    """What a moved loss's graph saved stays until its backward frees the graph; a stray
    reference to a disposed ref holds nothing (docs/scopes.md, 'what a moved graph holds')."""
    numel = 64 * MiB // 4  # 64 MiB of float32 per tensor
    w = torch.ones(1, requires_grad=True)
    stray: list[torch.Tensor] = []
    before = _rss()
    with ts.scope() as s:
        big = torch.ones(numel) * w  # mul saved torch.ones(numel) for w's gradient
        h = big.sin()  # sin saved big
        stray.extend([big, h])
        loss = s.move_to_outer(h.sum())
    held = _rss() - before
    assert big.is_disposed and h.is_disposed
    assert held > 1.5 * 64 * MiB, (
        f"the graph must keep its two saved tensors ({held / MiB:.0f} MiB)"
    )
    loss.backward()
    after = _rss() - before
    assert held - after > 1.5 * 64 * MiB, f"backward freed {(held - after) / MiB:.0f} MiB"
    assert torch.allclose(w.grad, torch.tensor([numel * math.cos(1.0)]), rtol=1e-3)


def test_a_stray_unmoved_tensor_releases_its_graph_at_exit() -> None:
    """The leak of a kept output (its graph and saved activations) ends at the scope's exit."""
    numel = 64 * MiB // 4
    w = torch.ones(1, requires_grad=True)
    stray: list[torch.Tensor] = []
    before = _rss()
    with ts.scope():
        out = (torch.ones(numel) * w).sin()  # its graph saved two 64 MiB tensors
        stray.append(out)
        during = _rss() - before
    after = _rss() - before
    assert during > 2.5 * 64 * MiB
    assert after < 0.5 * 64 * MiB, f"{after / MiB:.0f} MiB still held after the scope's exit"
    assert stray[0].is_disposed
