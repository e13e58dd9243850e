"""A block chain trained inside dispose scopes (both engines): AdamW ends with the plain
model's weights, and nothing made in the scopes stays alive."""

from __future__ import annotations

import torch
from chain_helpers import hf_step, tiny_hf, twins

import tensorscope as ts
from tensorscope.checkpoint import checkpoint_chain, min_memory


def test_training_in_scopes_with_adamw_ends_with_the_plain_weights() -> None:
    model, ref = twins(tiny_hf("gpt2"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with checkpoint_chain(model) as chained:
        for i in range(3):
            expected = hf_step(ref)
            opt_ref.step()
            opt_ref.zero_grad()
            with ts.scope():
                assert torch.equal(hf_step(model), expected)
                opt.step()
                opt.zero_grad()
            if i == 0:
                chained.compute_sequence(min_memory(chained.chain()) + chained.reserved_nbytes)
    assert ts.stats().live == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
