"""#7: multi-tensor ops (foreach / fused) on managed tensors under a budget below the total size
of the parameters: split transparently, results identical to plain, budget never exceeded."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import tensorscope as ts

from . import _models as M

Step = Callable[[nn.Module, torch.optim.Optimizer], None]


def _clip_norm(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # foreach: torch's default
    optimizer.step()


def _clip_value(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    optimizer.step()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


CASES: dict[str, tuple[Step, Callable[[nn.Module], torch.optim.Optimizer]]] = {
    "clip_grad_norm_": (_clip_norm, lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
    "clip_grad_value_": (_clip_value, lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
    "AdamW-foreach": (_step, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)),
    "AdamW-fused": (_step, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)),
}


def _train(case: str, *, managed: bool) -> tuple[list[float], dict[str, torch.Tensor], int | None]:
    step, make_optimizer = CASES[case]
    model = M.mlp()
    budget, handles = M.manage_under_budget(model) if managed else (None, [])
    optimizer = make_optimizer(model)
    losses = []
    for x, y in M.mlp_batches(3):
        with ts.scope():
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            step(model, optimizer)
            losses.append(loss.item())
    peak = ts.residency.report().peak_bytes if managed else None
    for handle in handles:
        handle.remove()
    assert budget is None or (peak is not None and peak <= budget), f"peak {peak} > {budget}"
    return losses, M.state_of(model), budget


@pytest.mark.parametrize("case", list(CASES))
def test_multi_tensor_op_under_a_budget_below_the_parameters_matches_plain(case: str) -> None:
    """#7: foreach/fused ops under a budget below the parameters: exact like plain, in budget."""
    expected_losses, expected_state, _ = _train(case, managed=False)
    ts.residency.reset()
    losses, state, budget = _train(case, managed=True)
    assert budget is not None and budget < M.param_bytes(M.mlp())
    assert losses == expected_losses
    assert state.keys() == expected_state.keys()
    for key, value in state.items():
        assert torch.equal(value, expected_state[key]), key


def test_a_multi_tensor_op_whose_single_index_exceeds_the_budget_says_what_budget_fits() -> None:
    """Split into groups, one index of ``_foreach_add_`` (two 16 KiB tensors) still needs
    32 KiB: the error names that size, not the whole op's, nothing moves, and the same op
    succeeds once the budget allows it, with plain's results."""
    torch.manual_seed(0)
    plain_a = [torch.randn(4096) for _ in range(3)]
    plain_b = [torch.randn(4096) for _ in range(3)]
    ts.residency.configure(device="cpu", policy="flow", budget="24KiB")
    a = [ts.ref(t.clone()).demote() for t in plain_a]
    b = [ts.ref(t.clone()).demote() for t in plain_b]
    with pytest.raises(ts.OutOfBudgetError, match="one index alone") as raised:
        torch._foreach_add_(a, b)
    assert "at least 32.0 KiB" in str(raised.value)
    assert [t.tier for t in a + b] == ["disk"] * 6
    ts.residency.configure(budget="32KiB")
    torch._foreach_add_(a, b)
    torch._foreach_add_(plain_a, plain_b)
    for got, expected in zip(a, plain_a, strict=True):
        assert torch.equal(got, expected)
    assert ts.residency.report().peak_bytes <= 32 * 1024
