"""Updates in row blocks (fit/statestore.py, NOTE [updates in row blocks]): a parameter whose
optimizer state is written out in blocks of rows is updated one block at a time, bit-identical
to the whole update, and ts.fit plans for it (a budget only that fits)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import tensorscope as ts
from tensorscope.fit.inbackward import InBackward
from tensorscope.fit.parts import states
from tensorscope.fit.statestore import StateStore, row_safe

from .fit_helpers import batches, big_vocabulary, differing, optimizer, step, twin

pytestmark = [
    pytest.mark.engine_independent,  # ts.fit outside scopes (checked)
    pytest.mark.strict,  # moves data through the device backend (tests/conftest.py)
]

OPTIMIZERS: dict[str, Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("rows", "cols", "block"), [(997, 33, 4096), (64, 96, 1024)])
def test_an_update_in_row_blocks_equals_the_whole_update(
    kind: str, rows: int, cols: int, block: int
) -> None:
    torch.manual_seed(0)
    mine = nn.Linear(cols, rows)
    theirs = twin(mine)
    opt, ref = OPTIMIZERS[kind](mine.parameters()), OPTIMIZERS[kind](theirs.parameters())
    assert row_safe(opt)
    store = StateStore(opt)
    store.enabled = True
    store.set_row_block(block)
    hooks = InBackward(opt)
    hooks.in_rows = store.update_in_rows
    after = opt.register_step_post_hook(lambda *_: store.after_step())  # as ts.fit's hook does
    try:
        for i in range(4):
            x = torch.randn(8, cols, generator=torch.Generator().manual_seed(i))
            mine(x).square().sum().backward()  # each parameter updated inside backward
            theirs(x).square().sum().backward()
            ref.step()
            ref.zero_grad()
            assert not differing(mine, theirs), i
            # between steps the weight's state is out, in row blocks
            spilled = [r for r in store._spilled.values() if r.blocks is not None]
            assert spilled and all(len(r.blocks or ()) > 1 for r in spilled)
        # the first update made the state (whole); the three after it ran in blocks
        assert store.block_updates == 3
        store.fetch_all()
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            for key, value in ref.state[q].items():
                assert torch.equal(opt.state[p][key], value), (kind, key)
    finally:
        after.remove()
        hooks.remove()
        store.close()


def test_a_fused_optimizer_is_updated_whole() -> None:
    p = nn.Parameter(torch.zeros(4, 4))
    # the fused kernels round differently at a block's edges: never split
    assert not row_safe(torch.optim.AdamW([p], fused=True))
    assert not row_safe(torch.optim.LBFGS([p]))
    assert row_safe(torch.optim.AdamW([p]))


SHORT = 4  # tokens per sequence: the logits are small, the embedding's update is the peak


def _least(name: str, block: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """The least budget of the candidate with the state offloaded and gradients freed."""
    monkeypatch.setattr(states, "ROW_BLOCK_BYTES", block)
    model = big_vocabulary(name)
    opt = optimizer("adamw", model)
    fit = ts.fit(model, opt, budget="1GiB")
    step(model, opt, next(batches(name, seq=SHORT)))
    assert fit.decision is not None
    fit.remove()
    return min(
        c.least_budget
        for c in fit.decision.candidates
        if c.base.state_offloaded and c.base.free_gradients
    )


@pytest.mark.filterwarnings("ignore:.*the measuring step:tensorscope.errors.FitWarning")
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_fit_updates_a_big_embedding_in_row_blocks_when_only_that_fits(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = 64 << 10
    whole, in_rows = _least(name, 0, monkeypatch), _least(name, block, monkeypatch)
    assert in_rows < whole  # the embedding's state (and its update's temporaries) in blocks
    budget = (whole + in_rows) // 2
    model = big_vocabulary(name)  # ROW_BLOCK_BYTES is `block` now
    ref = twin(model)
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget=budget)
    mine, theirs = batches(name, seq=SHORT), batches(name, seq=SHORT)
    for i in range(5):
        assert step(model, opt, next(mine), seed=i) == step(ref, ropt, next(theirs), seed=i)
        assert not differing(model, ref), i
    d = fit.decision
    assert d is not None and d.free_gradients and d.chosen.base.state_offloaded
    assert fit._states.store is not None and fit._states.store.block_updates > 0
    assert "64.0 KiB a block of rows at a time" in fit.explain()
    assert fit.plan_after is not None and fit.plan_after.peak_bytes <= budget
    sa, sb = opt.state_dict()["state"], ropt.state_dict()["state"]
    for k in sb:
        for key, value in sb[k].items():
            assert torch.equal(sa[k][key], value), (k, key)
    # a copy of the whole optimizer reads the state written in row blocks back whole
    copied = copy.deepcopy((model, opt))[1].state_dict()["state"]
    for k in sb:
        for key, value in sb[k].items():
            assert torch.equal(copied[k][key], value), (k, key)
    fit.remove()
