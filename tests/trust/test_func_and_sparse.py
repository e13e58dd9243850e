"""#10 and #11: torch.func transforms and sparse tensors inside scopes."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from torch.func import grad, hessian, jacrev, vjp

import tensorscope as ts

# ----------------------------------------------------------------------------- #10 torch.func


def _f(t: torch.Tensor) -> torch.Tensor:
    return (t.sin() * t).sum()


def _g(t: torch.Tensor) -> torch.Tensor:
    return t.sin() * t


TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "grad": lambda x: grad(_f)(x),
    "vjp": lambda x: vjp(_g, x)[1](torch.ones_like(x))[0],
    "jacrev": lambda x: jacrev(_g)(x),
    "hessian": lambda x: hessian(_f)(x),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_torch_func_transform_inside_a_scope_matches_plain(transform: str) -> None:
    """#10: torch.func grad/vjp/jacrev/hessian inside a scope give the plain result."""
    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    expected = TRANSFORMS[transform](x)
    with ts.scope():
        got = TRANSFORMS[transform](x)
        assert torch.equal(got, expected)


# ----------------------------------------------------------------------------- #11 sparse

SPARSE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "coo": lambda dense: dense.to_sparse(),
    "csr": lambda dense: dense.to_sparse_csr(),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("kind", list(SPARSE))
def test_a_scope_holding_a_sparse_tensor_exits_and_disposes_everything_it_owns(kind: str) -> None:
    """#11: a scope owning a sparse ref exits cleanly and disposes every ref it owned."""
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    with ts.scope() as s:
        sparse = SPARSE[kind](dense)
        product = sparse @ torch.ones(2, 1)
        later = torch.ones(3) * 2
        assert product.flatten().tolist() == [1.0, 2.0]
        owned = s.tracked()
    assert any(r is sparse for r in owned) and any(r is later for r in owned)
    alive = [tuple(r.shape) for r in owned if not r.is_disposed]
    assert alive == [], f"refs left undisposed after the scope: {alive}"


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("kind", list(SPARSE))
def test_stats_after_a_scope_with_a_sparse_tensor_count_only_real_disposals(kind: str) -> None:
    """#11: ts.stats() after a scope with a sparse ref counts only disposals that happened.

    An error at the scope's exit is tolerated here (it is the test above) so that the counters
    can be compared with the refs.
    """
    gc.collect()
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    scope = ts.scope()
    try:
        with scope:
            sparse = SPARSE[kind](dense)
            later = torch.ones(3) * 2
            owned = scope.tracked()
            before = ts.stats()
    except RuntimeError:
        pass
    after = ts.stats()
    assert any(r is sparse for r in owned) and any(r is later for r in owned)
    disposed = sum(r.is_disposed for r in owned)
    counted = after.disposed_in_scope - before.disposed_in_scope
    assert counted == disposed, f"stats count {counted} disposals, {disposed} happened"
    assert after.live == before.live - disposed
    assert disposed == len(owned), "the scope left refs undisposed"
