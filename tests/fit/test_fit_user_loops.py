"""ts.fit under training loops as users write them (trust round 4): hooks users put on blocks,
a loop whose steps differ from the recorded one. Every case compares with the plain twin bit
for bit after every step."""

from __future__ import annotations

import tensorscope as ts

from .fit_helpers import batches, differing, optimizer, step, tiny, twin


def test_full_backward_hook_on_a_block() -> None:
    """A full backward hook hands the block's forward a view of its input (an identity
    Function): still the chain, the hook sees plain's gradients."""
    model = tiny("gpt2")
    ref = twin(model)
    seen: list[float] = []
    theirs: list[float] = []
    for m, log in ((model, seen), (ref, theirs)):
        m.transformer.h[1].register_full_backward_hook(
            lambda mod, gin, gout, log=log: log.append(float(gout[0].norm()))
        )
    opt, ropt = optimizer("adamw", model), optimizer("adamw", ref)
    fit = ts.fit(model, opt, budget="1GiB")
    mine, other = batches("gpt2"), batches("gpt2")
    for i in range(4):
        assert step(model, opt, next(mine), seed=i, scoped=True) == step(
            ref, ropt, next(other), seed=i
        )
        assert not differing(model, ref)
    assert seen == theirs and len(seen) == 4
    fit.remove()
