"""``torch.amp.GradScaler("cpu")`` first used inside a scope (item 5).

The scaler is made before the loop, as users write it; its scale and growth tracker are created
lazily by the first ``scale()`` call, inside the first step's scope. The canonical recipe: scale,
backward, ``unscale_``, ``clip_grad_norm_``, ``step``, ``update``; 3 steps. With an initial scale
of 2**127 the scaled gradients overflow: the first steps are skipped and the scale backs off, so
both branches of ``update()`` run. Compared bit for bit with the same loop without tensorscope.
"""

from __future__ import annotations

import functools

import pytest
import torch

from . import _models as M

INIT_SCALES = {"2**16": 2.0**16, "2**127": 2.0**127}


def _scaled_training(mode: str, init_scale: float) -> tuple[torch.nn.Module, list[object]]:
    model = M.mlp()
    run = M.Run(mode)
    run.manage(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
    record: list[object] = []
    for x, y in M.mlp_batches(3):
        with run.step():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum")
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            record += [loss.item(), scaler.get_scale()]
    run.check_budget()
    record.append(scaler.state_dict())  # scale, growth tracker: usable after the last scope
    return model, record


@functools.cache
def _plain(init_scale: float) -> tuple[list[object], dict[str, torch.Tensor]]:
    model, record = _scaled_training("plain", init_scale)
    return record, M.state_of(model)


@pytest.mark.parametrize("mode", M.MODES)
@pytest.mark.parametrize("init_scale", list(INIT_SCALES))
def test_gradscaler_first_used_in_a_scope_matches_plain(init_scale: str, mode: str) -> None:
    expected_record, expected_state = _plain(INIT_SCALES[init_scale])
    model, record = _scaled_training(mode, INIT_SCALES[init_scale])
    assert record == expected_record
    M.assert_same_state(model, expected_state)


def test_overflowing_scale_skips_steps_in_the_plain_run() -> None:
    """The 2**127 case really exercises the skip-and-back-off branch."""
    record, _ = _plain(2.0**127)
    scales = record[1:6:2]
    assert scales[0] < 2.0**127
