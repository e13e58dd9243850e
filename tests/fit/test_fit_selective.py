"""ts.fit with blocks run selectively (NOTE [selective recomputation], checkpoint/simulate.py):
their matmuls' and dropout masks' results kept, the rest replayed in backward. Chosen where it
pays, bit-identical to plain, named by explain(), and
never offered for compiled blocks."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

import tensorscope as ts
from tensorscope.checkpoint import Chain
from tensorscope.checkpoint.profile import Profile
from tensorscope.errors import FitWarning, ScheduleError
from tensorscope.fit.decider import Decider

from .fit_helpers import differing, gpt2

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)

VOCAB, BATCH, SEQ = 256, 4, 64


def _data(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(n)]


def _step(model: Any, opt: torch.optim.Optimizer, ids: torch.Tensor, k: int) -> float:
    torch.manual_seed(k)  # dropout on: the same masks for both models
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def _free_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays priced at no time: where memory is short the DP runs blocks as Fs whatever this
    machine's timings (a re-timed step could otherwise find recomputing as fast)."""
    to_chain = Profile.to_chain

    def free(self: Profile, loss_tmp: int = 0) -> Chain:
        c = to_chain(self, loss_tmp)
        return Chain(
            c.fw, c.bw, c.x_sizes, c.xbar_sizes, c.fw_tmp, c.bw_tmp, c.loss_tmp,
            keeps_output=c.keeps_output, xsel_sizes=c.xsel_sizes, sel_bw=[0.0] * c.length,
            sel_bw_tmp=c.sel_bw_tmp,
        )  # fmt: skip

    monkeypatch.setattr(Profile, "to_chain", free)


def _least_without_placing(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(Decider, "_can_place", lambda self, free: False)
    model = gpt2(4, 128, VOCAB, SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=1 << 20)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitWarning)
            with pytest.raises(ScheduleError) as info:
                _step(model, opt, _data(1)[0], 0)
    finally:
        fit.remove()
    text = str(info.value)
    return int(text.split("the smallest budget that fits is ")[1].split("(")[1].split(" ")[0])


def test_blocks_run_selectively_where_memory_is_short_and_train_like_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _free_replays(monkeypatch)
    budget = _least_without_placing(monkeypatch) * 13 // 10  # room for some kept results
    model = gpt2(4, 128, VOCAB, SEQ)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=budget)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitWarning)  # the measuring step's peak
            for k, ids in enumerate(_data(6)):
                assert _step(model, opt, ids, k) == _step(ref, ref_opt, ids, k)
                assert differing(model, ref) == [], f"step {k + 1}"
                if k == 0:  # decided (later steps may re-time it into another choice)
                    assert fit.decision is not None
                    assert "selective" in fit.decision.blocks
                    assert "selective" in fit.explain()
        assert fit.plan_after is not None
        assert fit.measured_peak(fit.plan_after) <= budget
    finally:
        fit.remove()


def test_compiled_blocks_are_never_run_selectively() -> None:
    model = gpt2(2, 64, VOCAB, SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget="1GiB", compile=True)
    try:
        assert fit.chain is not None
        assert fit.chain.selective is False  # Inductor's partitioner chooses inside the graph
    finally:
        fit.remove()
    plain = ts.fit(model, opt, budget="1GiB")
    try:
        assert plain.chain is not None and plain.chain.selective is True
    finally:
        plain.remove()
