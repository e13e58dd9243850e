"""ts.fit offloading the blocks of transformers models built from tiny configs (random weights),
as a user's loop runs them (budget 70% of a plain step): plain, inside ts.scope(), with
clipping. Offload is forced (predicted free) so that it runs whatever this machine's bandwidth;
the decision by measured times is tested in tests/fit/test_fit_offload_plan.py. Losses and
weights equal plain's bit for bit, the measured peak stays within the budget; both scope
engines run the scoped case in CI."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch

import tensorscope as ts
from tests.fit.fit_helpers import gpt2, llama, offload_for_free

VOCAB, BATCH, SEQ = 1000, 4, 256


def _model(name: str) -> Any:
    if name == "gpt2":
        return gpt2(4, 128, VOCAB, SEQ)
    return llama(4, 128, 512, VOCAB, dropout=0.1)


def _step(model: Any, opt: torch.optim.Optimizer, ids: torch.Tensor, k: int, how: str) -> float:
    torch.manual_seed(k)
    with ts.scope() if how == "scope" else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if how == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss.item())


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    offload_for_free(monkeypatch)


# plain and clip never reach a scope engine (checked): they run once; scope runs under both.
ONCE = pytest.mark.engine_independent


@pytest.mark.usefixtures("forced")
@pytest.mark.parametrize(
    "how", [pytest.param("plain", marks=ONCE), "scope", pytest.param("clip", marks=ONCE)]
)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_offloaded_hf_blocks_train_like_plain(name: str, how: str) -> None:
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(5)]
    probe = _model(name)
    with ts.record() as rec:
        _step(probe, torch.optim.AdamW(probe.parameters(), lr=1e-3), data[0], 0, how)
    budget = int(rec.plan().peak_bytes * 0.7)
    model = _model(name)
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    fit = ts.fit(model, opt, budget=budget)
    try:
        for k, ids in enumerate(data):
            assert _step(model, opt, ids, k, how) == _step(plain, plain_opt, ids, k, how)
        pairs = zip(model.parameters(), plain.parameters(), strict=True)
        assert all(torch.equal(p, q) for p, q in pairs)
        assert fit.decision is not None and "offload" in fit.decision.blocks
        assert fit.plan_after is not None and fit.measured_peak(fit.plan_after) <= budget
    finally:
        fit.remove()
