"""Run a transformers model you did not write under a device budget: three lines of tensorscope.

Run: ``pip install -e ".[bench]" && python examples/offload_transformers.py``. The model is
GPT-2-small-shaped, built from its config with random weights (nothing is downloaded).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import tensorscope as ts


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()  # 124M parameters, ~475 MiB of fp32 weights
    tokens = torch.randint(0, model.config.vocab_size, (1, 64))
    with torch.no_grad():
        expected = model(tokens).logits

    # The three lines:
    ts.residency.configure(
        device="cpu", policy="flow", budget="160MiB"
    )  # the embedding alone is 147 MiB
    handle = ts.manage(model)
    with torch.no_grad():
        logits = model(tokens).logits

    print("same logits as plain:", torch.allclose(logits, expected, atol=1e-5))
    print(ts.residency.report())
    handle.remove()


if __name__ == "__main__":
    main()
