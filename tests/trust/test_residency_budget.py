"""#14 and #16: shrinking the budget while tensors are managed, and managing a module twice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tensorscope as ts

MiB = 1 << 20


def _four_resident_mebibytes() -> list[ts.TensorRef]:
    refs = [ts.ref(torch.full((MiB // 4,), float(i))) for i in range(4)]
    for t in refs:
        t.demote()
        t.promote()  # managed and resident: 4 x 1 MiB on the device tier
    assert [t.tier for t in refs] == ["device"] * 4
    assert ts.residency.report().tiers["device"].resident_bytes == 4 * MiB
    return refs


@pytest.mark.parametrize(("budget", "resident"), [("3MiB", 3), ("1MiB", 1)])
def test_a_smaller_budget_demotes_exactly_the_excess(budget: str, resident: int) -> None:
    """#14: a smaller budget demotes exactly the excess; the tensors stay usable within it."""
    refs = _four_resident_mebibytes()
    ts.residency.configure(budget=budget)
    device = [t for t in refs if t.tier == "device"]
    assert ts.residency.report().tiers["device"].resident_bytes == resident * MiB
    assert len(device) == resident, [t.tier for t in refs]
    ts.residency.report(reset=True)
    for i, t in enumerate(refs):
        t.mul_(1)  # operand alone: fits the new budget
        assert torch.equal(t, torch.full((MiB // 4,), float(i)))
    assert ts.residency.report().peak_bytes <= resident * MiB


def test_managing_a_module_twice_then_removing_in_order_leaves_plain_parameters() -> None:
    """#16: manage() twice then remove() in order leaves plain nn.Parameters with their values.

    Either acceptable fix passes: the second ``manage()`` raising a TensorScopeError (then the
    first handle's ``remove()`` must restore plain parameters), or order-independent removal.
    """
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    expected = {k: v.detach().clone() for k, v in model.named_parameters()}
    first = ts.manage(model)
    try:
        second = ts.manage(model)
    except ts.TensorScopeError:
        handles = [first]
    else:
        handles = [first, second]
    for handle in handles:
        handle.remove()
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter, f"{name} is still a {type(p).__name__}"
        assert torch.equal(p.detach(), expected[name]), name
