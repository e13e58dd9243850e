"""ts.fit's chunked LM loss as a decision (fit/parts/chunked.py): chosen only where it is
predicted faster or nothing fits without it; then the logits never exist whole and results are
allclose to plain (not its bits); otherwise the plain loss and plain bits."""

from __future__ import annotations

import torch

import tensorscope as ts

from .fit_helpers import BIG_VOCAB, big_vocabulary, differing, optimizer, step, twin


def _batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(6):
        ids = torch.randint(0, BIG_VOCAB, (4, 64), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _plain_peak() -> int:
    model = big_vocabulary("llama")
    opt = optimizer("adamw", model)
    data = _batches()
    step(model, opt, data[0])
    with ts.record() as rec:
        step(model, opt, data[1])
    return rec.plan().peak_bytes


ROWS = 4 * 64  # a batch's positions: the whole logits' rows


def _logits_rows(plan: ts.MemoryPlan) -> list[int]:
    """Rows of every storage whose last dimension is the vocabulary."""
    return [
        life.nbytes // (BIG_VOCAB * 4)
        for life in plan.lifetimes
        if len(life.shape) >= 2 and life.shape[-1] == BIG_VOCAB
    ]


def test_the_loss_runs_in_chunks_where_only_that_fits() -> None:
    budget = int(_plain_peak() * 0.5)
    model = big_vocabulary("llama")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    data = _batches()
    for i, batch in enumerate(data):
        mine = step(model, opt, batch, seed=i, scoped=True)
        theirs = step(ref, ropt, batch, seed=i)
        assert abs(mine - theirs) <= 1e-5 * abs(theirs), (i, mine, theirs)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
    d = fit.decision
    assert d is not None and d.chosen.base.chunked_loss
    assert not any(c.fits for c in d.candidates if not c.base.chunked_loss)
    assert fit.plan_before is not None and max(_logits_rows(fit.plan_before)) >= ROWS  # step 1
    assert fit.plan_after is not None and max(_logits_rows(fit.plan_after)) <= ROWS // 4  # chunks
    assert fit.measured_peak(fit.plan_after) <= budget
    assert "row chunks" in fit.explain() and "allclose" in fit.explain()
    with torch.no_grad():  # evaluation keeps its logits
        assert model.eval()(**data[0]).logits is not None
    fit.remove()
    assert "forward" not in vars(model)


def test_a_roomy_budget_keeps_the_plain_loss_and_its_bits() -> None:
    model = big_vocabulary("gpt2")
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget="1GiB")
    for i, batch in enumerate(_batches()[:4]):
        assert step(model, opt, batch, seed=i) == step(ref, ropt, batch, seed=i)
        assert not differing(model, ref)
    assert fit.decision is not None and not fit.decision.chosen.base.chunked_loss
    assert any(c.base.chunked_loss for c in fit.decision.candidates)  # considered, not chosen
    assert "row chunks" not in fit.explain()
    fit.remove()


def test_a_model_that_is_not_a_causal_lm_is_never_chunked() -> None:
    from .fit_helpers import tiny

    model = tiny("mlp")
    fit = ts.fit(model, optimizer("sgd", model), budget="1GiB")
    assert fit._chunked.why_not and fit._chunked.head() is None
    fit.remove()
