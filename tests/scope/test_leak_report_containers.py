"""The leak report and what the scope's own frame holds through containers (issue 15).

Locals bound inside the scope are not leaks, and neither is what they hold: a dict of lists, a
``ModelOutput`` with its cache, a dataclass. A container that is also referenced from outside
the scope (appended to a list made before it) is a leak, and so is what it holds.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

import tensorscope as ts


@dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


def _leaks(run: object) -> list[ts.LeakRecord]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ts.LeakWarning)
        return run()  # type: ignore[operator, no-any-return]


def test_what_new_locals_hold_through_containers_is_not_a_leak() -> None:
    def run() -> list[ts.LeakRecord]:
        with ts.scope(report_leaks=True) as s:
            batch = {"pair": [torch.randn(2), torch.randn(2)], "nested": ({"x": torch.ones(1)},)}
            pair = Pair(torch.zeros(3), torch.ones(3))
            assert len(s) == 5 and batch and pair
        return s.leaks

    assert _leaks(run) == []


def test_a_container_also_held_from_outside_leaks_what_it_holds() -> None:
    history: list[object] = []

    def run() -> list[ts.LeakRecord]:
        with ts.scope(report_leaks=True) as s:
            batch = {"pair": [torch.randn(2), torch.randn(4)]}
            history.append(batch)  # the dict outlives the scope
            kept = torch.ones(5)
            history.append(kept)
        return s.leaks

    leaks = _leaks(run)
    assert sorted(record.shape for record in leaks) == [(2,), (4,), (5,)]
    assert all("held by" in str(record) for record in leaks)
