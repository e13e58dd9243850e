"""The memory plan of a transformers GPT-2 training step: the picture in docs/plan.md.

Run: ``python examples/plan_transformers.py [OUT.png]`` (default ``docs/images/plan_gpt2.png``).
A GPT-2 built from a small config (4 layers, hidden 256, vocab 8192; random weights, nothing
downloaded), AdamW, a batch of 4 x 128 tokens. The second step is recorded (the first one
creates AdamW's state), then the plan is printed, drawn, and asked what three changes would
save.
"""

from __future__ import annotations

import sys

import torch

import tensorscope as ts


def main(out: str = "docs/images/plan_gpt2.png") -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=8192, n_positions=256, n_embd=256, n_layer=4, n_head=4, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (4, 128))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    with ts.record() as rec:
        step()
    plan = rec.plan()
    print(plan)
    plan.save_png(out, title="GPT-2 (4 x 256, vocab 8192), AdamW, batch 4 x 128: one step")
    print(f"\nwrote {out}")
    print(plan.what_if(recompute=["transformer.h"]))
    print(plan.what_if(offload=["transformer.h"]))
    print(plan.what_if(free_gradients=True))


if __name__ == "__main__":
    main(*sys.argv[1:2])
