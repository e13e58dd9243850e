"""``torch.func`` transforms inside a scope equal the plain results (item 7).

``grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``, ``hessian``, ``vmap``, and the per-sample
gradient recipe (``vmap(grad(...))`` over ``functional_call``), each called inside a scope and
compared bit for bit with the same call outside any scope.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import func

import tensorscope as ts

from . import _models as M


def f(x: torch.Tensor) -> torch.Tensor:
    return (torch.sin(x) * x.exp()).sum() + (x @ x.flip(0)) ** 2


def g(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * x.cumsum(0)


def _x() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 5)


def _batch() -> torch.Tensor:
    return torch.randn(3, 5, generator=torch.Generator().manual_seed(0))


def _vjp(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out, pullback = func.vjp(g, x)
    return (out, *pullback(torch.ones_like(out)))


def _jvp(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return func.jvp(g, (x,), (torch.ones_like(x),))


def _per_sample_grads(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    model = M.mlp(depth=1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    targets = torch.zeros(x.shape[0], 4)

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = func.functional_call(model, p, (xi.unsqueeze(0),))
        return torch.nn.functional.mse_loss(out, yi.unsqueeze(0))

    grads = func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, targets)
    return tuple(grads[k] for k in sorted(grads))


TRANSFORMS: dict[str, tuple[Callable[[torch.Tensor], object], Callable[[], torch.Tensor]]] = {
    "grad": (func.grad(f), _x),
    "grad_and_value": (func.grad_and_value(f), _x),
    "vjp": (_vjp, _x),
    "jvp": (_jvp, _x),
    "jacrev": (func.jacrev(g), _x),
    "jacfwd": (func.jacfwd(g), _x),
    "hessian": (func.hessian(f), _x),
    "vmap": (func.vmap(g), _batch),
    "vmap_jacrev": (func.vmap(func.jacrev(g)), _batch),
    "per_sample_grads": (_per_sample_grads, lambda: torch.randn(6, 16)),
}


def _flatten(result: object) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    assert isinstance(result, tuple | list)
    return [t for item in result for t in _flatten(item)]


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transform_inside_a_scope_matches_plain(transform: str) -> None:
    fn, make_input = TRANSFORMS[transform]
    torch.manual_seed(5)
    x = make_input()
    expected = [t.clone() for t in _flatten(fn(x))]
    before = ts.stats().live
    with ts.scope():
        got = _flatten(fn(x))
        assert len(got) == len(expected)
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(a, b), f"output {i}"
    del got
    assert ts.stats().live == before
    M.assert_alive(x, "the input")
