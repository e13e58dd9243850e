"""A training loop with one dispose scope per step, and a leak report on the first one.

Run: ``python examples/scoped_training.py``. Training is bit-identical to the same loop
without scopes; the scope releases everything the step created, including what a stray
reference would otherwise keep alive.
"""

from __future__ import annotations

import torch
from torch import nn

import tensorscope as ts


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(8)]
    losses: list[float] = []
    for step, (x, y) in enumerate(batches):
        with ts.scope(name=f"step {step}"):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())  # keep numbers, not tensors
    print("losses:", " ".join(f"{v:.3f}" for v in losses))
    print("refs alive after training:", ts.stats().live)


if __name__ == "__main__":
    main()
