"""Aliases user code asks for by name -- ``torch.ops.aten.alias``, ``torch.ops.aten.detach`` (the
op packets and their ``.default`` overloads) and ``torch.detach`` -- of a ref inside a scope
are refs of the scope, as views are (API §2), while torch's own C uses of ``alias``/``detach``
(``nn.Parameter``, ``as_subclass``, ``_make_subclass``, ``numpy()``) keep working on refs
(_aliases.py, NOTE [aliases user code asks for])."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import tensorscope as ts

from ._support import StatsChecker

ALIASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "aten.alias": lambda t: torch.ops.aten.alias(t),
    "aten.alias.default": lambda t: torch.ops.aten.alias.default(t),
    "aten.alias(self=)": lambda t: torch.ops.aten.alias.default(self=t),
    "aten.detach": lambda t: torch.ops.aten.detach(t),
    "aten.detach.default": lambda t: torch.ops.aten.detach.default(t),
    "torch.detach": lambda t: torch.detach(t),
}


class Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("name", list(ALIASES))
def test_an_alias_of_a_ref_is_a_ref_of_the_current_scope(name: str, stats: StatsChecker) -> None:
    alias = ALIASES[name]
    with ts.scope() as outer:
        t = torch.arange(4.0)
        with ts.scope() as inner:
            a = alias(t)
            assert type(a) is ts.TensorRef and a.scope is inner
            assert a.data_ptr() == t.data_ptr() and a is not t
            assert torch.equal(a, t) and len(inner) == 1
        assert a.is_disposed and not t.is_disposed and t.scope is outer
        with pytest.raises(ts.DisposedTensorError, match=r"test_requested_aliases\.py:\d+"):
            a + 1
    stats(created_in_scope=2, disposed_in_scope=2)


@pytest.mark.parametrize("name", list(ALIASES))
def test_an_alias_of_a_plain_tensor_or_a_parameter_stays_plain(name: str) -> None:
    plain, parameter = torch.ones(3), torch.nn.Parameter(torch.ones(3))
    with ts.scope() as s:
        for source in (plain, parameter):
            out = ALIASES[name](source)
            assert type(out) is torch.Tensor  # as ``p.detach()``: nothing to own
        assert len(s) == 0


@pytest.mark.parametrize("name", list(ALIASES))
def test_where_no_scope_owns_results_an_alias_of_a_ref_is_plain(name: str) -> None:
    with ts.scope():  # the aliases are owned from the first scope on (installed there)
        u = torch.ones(3).detach_from_scope()
    assert type(u) is ts.TensorRef
    assert type(ALIASES[name](u)) is torch.Tensor  # as every op on a ref outside scopes
    assert type(u.view(3)) is torch.Tensor
    assert type(u.detach()) is ts.TensorRef  # ``detach()`` alone: for ``nn.Parameter(ref)``


def test_an_alias_keeps_autograd() -> None:
    w = torch.ones(3, requires_grad=True)
    with ts.scope() as s:
        y = w * 2
        a = torch.ops.aten.alias(y)
        assert a.requires_grad and a.scope is s
        (a * 3).sum().backward()
        d = torch.ops.aten.detach(y)
        assert not d.requires_grad and d.scope is s
    assert torch.equal(w.grad, torch.full((3,), 6.0))


def test_torchs_own_uses_of_alias_and_detach_work_on_refs() -> None:
    with ts.scope() as s:
        t = torch.arange(4.0)
        sub = t.as_subclass(Sub)  # C: alias, then a new Python object of the subclass
        assert type(sub) is Sub and sub.data_ptr() == t.data_ptr()
        made = torch.Tensor._make_subclass(Sub, t)
        assert type(made) is Sub
        parameter = torch.nn.Parameter(t)
        assert type(parameter) is torch.nn.Parameter and parameter.data_ptr() == t.data_ptr()
        assert t.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
        a = torch.ops.aten.alias(t)
        assert a.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert len(s) == 2 and a.scope is s  # t and the alias
    assert type(parameter) is torch.nn.Parameter and parameter.sum().item() == 6.0


def test_an_op_object_keeps_its_identity_and_hash() -> None:
    with ts.scope():  # installed at the first scope
        pass
    packet = torch.ops.aten.alias
    assert isinstance(packet, torch._ops.OpOverloadPacket)
    assert isinstance(packet.default, torch._ops.OpOverload)
    assert packet.default is torch.ops.aten.alias.default
    assert hash(packet.default) == hash(packet.default._op)
    assert {packet.default: 1}[torch.ops.aten.alias.default] == 1
