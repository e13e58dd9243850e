"""ts.fit with blocks run selectively (NOTE [selective recomputation], checkpoint/simulate.py):
their matmuls' and dropout masks' results kept, the rest replayed in backward. Chosen where it
pays (the ``free_replays`` fixture makes it pay whatever the machine's timings), bit-identical
to plain, named by explain(), and never offered for compiled blocks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import tensorscope as ts
from tensorscope.errors import FitWarning
from tensorscope.fit.decider import Decider

from .fit_helpers import (
    LEAST_SEQ,
    LEAST_VOCAB,
    differing,
    gpt2,
    least_batches,
    least_budget,
    least_gpt2,
    seeded_step,
)

pytestmark = pytest.mark.engine_independent  # ts.fit outside scopes (checked)


@pytest.mark.usefixtures("free_replays")  # tests/conftest.py
def test_blocks_run_selectively_where_memory_is_short_and_train_like_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        budget = least_budget(mp) * 13 // 10  # without placing; room for some kept results
    monkeypatch.setattr(Decider, "_can_place", lambda self, free: False)
    model = least_gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=budget)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitWarning)  # the measuring step's peak
            for k, ids in enumerate(least_batches(6)):
                assert seeded_step(model, opt, ids, k) == seeded_step(ref, ref_opt, ids, k)
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
    model = gpt2(2, 64, LEAST_VOCAB, LEAST_SEQ)
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
