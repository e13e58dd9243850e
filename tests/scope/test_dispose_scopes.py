"""Dispose scopes: the cases of TorchSharp's TestDisposeScopes.cs, plus the rest of API.md §1.

The first block ports TorchSharp's tests one to one (each docstring names the C# test); the
blocks after it cover the contract's nesting, moving, include/exclude, dispose-everything,
out-of-order close, closed-scope and membership rules.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorscope as ts


def contains(tensors: list[torch.Tensor], t: torch.Tensor) -> bool:
    """Membership by identity: ``x in list`` would compare tensors elementwise."""
    return any(x is t for x in tensors)


def usable(t: torch.Tensor) -> bool:
    """True when ``t`` can still be computed with (a disposed ref raises)."""
    t.sum()
    return True


# --------------------------------------------------------------------------------------------
# Ports of TorchSharp's TestDisposeScopes.cs
# --------------------------------------------------------------------------------------------


def test_minimal_dispose_works(stats) -> None:
    """TorchSharp: MinimalDisposeWorks."""
    with ts.scope() as s:
        a1 = torch.randn(())  # caught by the scope
        a2 = torch.randn(()).detach_from_scope()  # leaves the scope
        a3 = torch.randn(()).move_to_outer()  # no outer scope: becomes unowned
        a4 = torch.randn(())  # disposed by hand before the scope closes
        tracked = s.tracked()
        assert contains(tracked, a1)
        assert not contains(tracked, a2)
        assert not contains(tracked, a3)
        assert contains(tracked, a4)
        del tracked
        a4.dispose()

    stats(created_in_scope=4, disposed_in_scope=2, detached=2, live=2)
    assert a1.is_disposed
    assert a4.is_disposed
    assert not a2.is_disposed
    assert not a3.is_disposed
    assert a2.scope is None
    assert a3.scope is None


def test_dispose_everything_but_works() -> None:
    """TorchSharp: DisposeEverythingButWorks."""
    with ts.scope() as s:
        a1 = torch.randn(())
        a2 = torch.randn(())
        a3 = torch.randn(())
        a4 = torch.randn(())
        for a in (a1, a2, a3, a4):
            assert a in s

        s.dispose_everything_but(a4)

        assert a1 not in s
        assert a2 not in s
        assert a3 not in s
        assert a4 in s
        assert a1.is_disposed and a2.is_disposed and a3.is_disposed
        assert not a4.is_disposed
        assert not s.is_closed
    assert a4.is_disposed


def test_stacked_scopes_works_as_intended() -> None:
    """TorchSharp: StackedScopesWorksAsIntended."""
    with ts.scope() as scope1:
        a1 = torch.randn(())
        with ts.scope() as scope2:
            # moving to the outer scope works
            a2 = torch.randn(())
            assert a2 in scope2
            scope2.move_to_outer(a2)
            assert a2 not in scope2
            assert a2 in scope1
            assert a1 in scope1

            # moving out of every scope works
            a6 = torch.randn(())
            scope2.exclude(a6)
            assert a6 not in scope2
            assert a6 not in scope1
            assert a6.scope is None

            a3 = torch.randn(())
            a4 = torch.randn(())
            scope2.dispose_everything_but(a4)
            assert a3.is_disposed
            assert not a4.is_disposed

            a5 = torch.randn(())
            assert a5 in scope2
            a5.dispose()
            assert a5 not in scope2

        assert not a1.is_disposed
        assert not a2.is_disposed
        assert a4.is_disposed
        assert not a6.is_disposed

    assert a1.is_disposed
    assert a2.is_disposed
    assert not a6.is_disposed


def test_tensors_are_disposed_correctly() -> None:
    """TorchSharp: TensorsAreDisposedCorrectly."""
    data = torch.rand(10, 10)  # no scope open: a plain tensor, never owned
    with ts.scope() as s:
        new_value = data * data + data
        tracked = s.tracked()
        assert contains(tracked, new_value)
        for t in tracked:
            assert isinstance(t, ts.TensorRef)
            assert not t.is_disposed

    for t in tracked:
        assert t.is_disposed
    assert new_value.is_disposed
    assert type(data) is torch.Tensor
    assert usable(data)


def test_tensors_that_should_not_be_disposed_arent() -> None:
    """TorchSharp: TensorsThatShouldNotBeDisposedArent."""
    data = torch.rand(10, 10)
    with ts.scope() as s:
        undisposed = s.move_to_outer(data * data + data)
        assert not undisposed.is_disposed
        assert undisposed not in s

    assert not undisposed.is_disposed
    assert undisposed.scope is None
    assert torch.equal(undisposed, data * data + data)


def test_tensors_can_be_disposed_in_the_middle_of_the_process() -> None:
    """TorchSharp: TensorsCanBeDisposedInTheMiddleOfTheProcess."""
    data = torch.rand(10, 10)
    with ts.scope() as s:
        t1 = data * data + data
        t2 = data + data - t1
        kept = s.dispose_everything_but(t2)
        assert kept is t2
        assert t1.is_disposed
        assert not t2.is_disposed
        t3 = t2 + data
        assert t3 in s

    assert t2.is_disposed
    assert t3.is_disposed
    assert type(data) is torch.Tensor
    assert usable(data)


def test_dispose_scopes_can_be_nestled(stats) -> None:
    """TorchSharp: DisposeScopesCanBeNestled."""
    with ts.scope():
        data = torch.rand(10, 10)
        t1 = data * data + data
        live_before_inner = ts.stats().live
        with ts.scope():
            t2 = data + data - t1
            assert ts.stats().live > live_before_inner
        # the inner scope's tensors were disposed
        assert t2.is_disposed
        assert ts.stats().live == live_before_inner

    # everything was disposed
    assert ts.stats().live == 0
    assert data.is_disposed and t1.is_disposed


def _mlp_training(steps: int) -> nn.Module:
    """A TorchSharp TestTraining-style loop, everything (model included) built in the caller."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, 2))
    x = torch.randn(16, 20)
    y = torch.randn(16, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return model


def test_dispose_scope_works_for_test_training1(stats) -> None:
    """TorchSharp: DisposeScopeWorksForTestTraining1."""
    with ts.scope():
        model = _mlp_training(steps=5)

    # parameters are never disposed, even when created inside the scope
    for p in model.parameters():
        assert not getattr(p, "is_disposed", False)
        assert usable(p)
    assert model(torch.randn(3, 20)).shape == (3, 2)
    del model, p  # the loop variable still held the last parameter
    gc_and_check_no_live_refs()


def test_dispose_scope_works_for_test_training_conv2d(stats) -> None:
    """TorchSharp: DisposeScopeWorksForTestTrainingConv2d."""
    with ts.scope() as s:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, stride=2),
            nn.ReLU(inplace=True),
            nn.Dropout(0.1),
            nn.Flatten(),
            nn.Linear(4 * 7 * 7, 8),
            nn.ReLU(inplace=True),
            nn.Linear(8, 3),
        )
        x = torch.randn(4, 3, 16, 16)
        y = torch.randn(4, 3)
        optimizer = torch.optim.Adam(model.parameters())
        for _ in range(3):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        assert len(s) > 0

    assert loss.is_disposed and x.is_disposed
    for p in model.parameters():
        assert not getattr(p, "is_disposed", False)
        assert usable(p)
    state_tensors = [v for st in optimizer.state.values() for v in st.values()]
    assert len(state_tensors) == 3 * len(list(model.parameters()))  # step, exp_avg, exp_avg_sq
    for value in state_tensors:
        assert not getattr(value, "is_disposed", False)
        assert usable(value)
    del model, optimizer, state_tensors, value, p
    gc_and_check_no_live_refs()


def gc_and_check_no_live_refs() -> None:
    """Once the user dropped everything, no ref is live (whether or not params are refs)."""
    gc.collect()
    assert ts.stats().live == 0


def test_move_dispose_scope() -> None:
    """TorchSharp: TestMoveDisposeScope (``MoveToOtherDisposeScope(x)`` -> ``move_to_scope``)."""
    t0a = ts.ref(torch.rand(10))  # unowned
    t0b = ts.ref(torch.rand(10))  # unowned

    # moving an unowned ref to the scope of another unowned ref does nothing
    assert t0a.move_to_scope(t0b.scope) is t0a
    assert t0a.scope is None

    with ts.scope() as d1:
        t1 = torch.rand(10)
        with ts.scope() as d2:
            t2 = torch.rand(20)
            with ts.scope() as d3:
                t3_0a = torch.rand(20)
                t3_0b = torch.rand(20)
                t3_1 = torch.rand(20)
                t3_2 = torch.rand(20)

                t3_0a.move_to_scope(t0a.scope)  # unowned: survives every scope
                t0b.move_to_scope(t3_0b.scope)  # adopted by d3: dies with it
                t3_1.move_to_scope(t1.scope)  # to d1
                t3_2.move_to_scope(t2.scope)  # to d2
                assert t3_0a.scope is None
                assert t0b.scope is d3
                assert t3_1.scope is d1
                assert t3_2.scope is d2

            assert t3_0b.is_disposed
            assert t0b.is_disposed
            assert not t3_2.is_disposed

        assert t3_2.is_disposed
        assert not t3_1.is_disposed

    assert t3_1.is_disposed
    assert not t3_0a.is_disposed
    assert not t0a.is_disposed


def test_memory_management_example() -> None:
    """TorchSharp: MemoryManagementExample (older TestDisposeScopes.cs)."""
    with ts.scope() as d:
        predicted_labels = torch.rand(5, 5)
        labels = torch.tensor([1, 0, 1, 0, 1])
        am = predicted_labels.argmax(1)
        eq = am == labels
        expected = int(eq.sum().item())

        # a long process can dispose mid-stream
        d.dispose_everything_but(eq)
        assert predicted_labels.is_disposed and labels.is_disposed and am.is_disposed
        assert len(d) == 1 and eq in d

        # this last value leaves the scope, so it can be used outside
        total = d.exclude(eq.sum())

    assert eq.is_disposed
    assert not total.is_disposed
    assert total.scope is None
    assert total.item() == expected


# --------------------------------------------------------------------------------------------
# Scopes, nesting and the current scope
# --------------------------------------------------------------------------------------------


def test_scope_name_and_outer() -> None:
    """A scope has the given name (default None) and links to the enclosing scope."""
    assert ts.current_scope() is None
    with ts.scope(name="outer") as outer:
        assert outer.name == "outer"
        assert outer.outer is None
        assert not outer.is_closed
        with ts.scope() as inner:
            assert inner.name is None
            assert inner.outer is outer
    assert outer.is_closed and inner.is_closed
    assert outer.name == "outer"


def test_current_scope_follows_nesting() -> None:
    """``ts.current_scope()`` is the innermost open scope, and ``None`` outside all scopes."""
    assert ts.current_scope() is None
    with ts.scope() as s1:
        assert ts.current_scope() is s1
        with ts.scope() as s2:
            assert ts.current_scope() is s2
            with ts.scope() as s3:
                assert ts.current_scope() is s3
            assert ts.current_scope() is s2
        assert ts.current_scope() is s1
    assert ts.current_scope() is None


def test_tensors_belong_to_innermost_scope() -> None:
    """Inside a scope every tensor a torch call returns is a TensorRef of the innermost scope."""
    with ts.scope() as outer:
        a = torch.randn(3)
        with ts.scope() as inner:
            b = torch.randn(3)
            c = a + b  # an op on a ref of the outer scope still belongs to the innermost
            assert (b.scope, c.scope) == (inner, inner)
        d = a * 2
        assert (a.scope, d.scope) == (outer, outer)
        assert b.is_disposed and c.is_disposed
        assert not a.is_disposed and not d.is_disposed
    for t in (a, b, c, d):
        assert isinstance(t, ts.TensorRef)
        assert isinstance(t, torch.Tensor)
        assert t.is_disposed


def test_ownership_while_open() -> None:
    """``t.scope`` names the owner while the scopes are open."""
    with ts.scope() as outer:
        a = torch.randn(3)
        with ts.scope() as inner:
            b = torch.randn(3)
            c = a + b
            assert a.scope is outer
            assert b.scope is inner
            assert c.scope is inner
            assert a in outer and a not in inner
            assert b in inner and b not in outer
        d = a * 2
        assert d.scope is outer


def test_tensors_created_outside_scopes_are_plain() -> None:
    """With no scope open, torch runs untouched: factories and ops return plain tensors."""
    x = torch.randn(3)
    y = x + 1
    assert type(x) is torch.Tensor
    assert type(y) is torch.Tensor
    u = ts.ref(torch.randn(3))
    assert type(u + 1) is torch.Tensor  # ops on refs too
    assert type(u.view(3)) is torch.Tensor
    assert type(u[0]) is torch.Tensor


def test_plain_tensor_created_before_scope_is_never_disposed() -> None:
    """A plain tensor used inside a scope is not owned by it and survives its close."""
    x = torch.arange(6.0)
    with ts.scope() as s:
        y = x * 2
        assert x not in s
        assert y in s
    assert type(x) is torch.Tensor
    assert torch.equal(x, torch.arange(6.0))


def test_disposing_inner_does_not_touch_outer() -> None:
    """Closing the inner scope disposes its own refs only."""
    with ts.scope() as outer:
        a = torch.randn(3)
        with ts.scope():
            b = a + 1
        assert b.is_disposed
        assert not a.is_disposed
        assert a in outer
        assert usable(a)


# --------------------------------------------------------------------------------------------
# move_to_outer
# --------------------------------------------------------------------------------------------


def test_move_to_outer_moves_one_level() -> None:
    """``t.move_to_outer()`` hands the ref to the enclosing scope and returns it."""
    with ts.scope() as s1:
        with ts.scope() as s2:
            with ts.scope() as s3:
                t = torch.randn(2)
                assert t.move_to_outer() is t
                assert t.scope is s2
                assert t not in s3 and t in s2
                t.move_to_outer()
                assert t.scope is s1
            assert not t.is_disposed
        assert not t.is_disposed
        assert t in s1
    assert t.is_disposed


def test_move_to_outer_uses_owning_scope_not_current() -> None:
    """``t.move_to_outer()`` goes to the outer of the scope that owns ``t``, not of the current."""
    with ts.scope() as s1, ts.scope():
        t = torch.randn(2)  # owned by the middle scope
        with ts.scope() as s3:
            t.move_to_outer()
            assert t.scope is s1
            assert t not in s3


def test_move_to_outer_of_outermost_leaves_unowned() -> None:
    """Moving out of the outermost scope leaves the ref unowned, so it survives."""
    with ts.scope() as s:
        t = torch.randn(2).move_to_outer()
        u = torch.randn(2)
        assert s.move_to_outer(u) is u
        assert t.scope is None and u.scope is None
        assert len(s) == 0
    assert not t.is_disposed and not u.is_disposed


def test_move_to_outer_of_unowned_is_noop() -> None:
    """An unowned ref stays unowned (and is returned) whether or not a scope is open."""
    u = ts.ref(torch.randn(2))
    assert u.move_to_outer() is u
    assert u.scope is None
    with ts.scope() as s:
        assert u.move_to_outer() is u
        assert u.scope is None
        assert u not in s
    assert not u.is_disposed


def test_scope_move_to_outer_ignores_refs_it_does_not_own() -> None:
    """``s.move_to_outer`` only moves refs that ``s`` owns; others keep their owner."""
    u = ts.ref(torch.randn(2))
    with ts.scope() as s1:
        a = torch.randn(2)
        with ts.scope() as s2:
            b = torch.randn(2)
            result = s2.move_to_outer(a, b, u)
            assert isinstance(result, tuple)
            assert len(result) == 3
            assert result[0] is a and result[1] is b and result[2] is u
            assert a.scope is s1  # not moved further out
            assert b.scope is s1
            assert u.scope is None


def test_scope_move_to_outer_returns_arguments() -> None:
    """One tensor in, that tensor out; several in, a tuple out, so unpacking reads naturally."""
    with ts.scope(), ts.scope() as inner:
        a = torch.randn(2)
        b = torch.randn(2)
        assert inner.move_to_outer(a) is a
        c = torch.randn(2)
        b2, c2 = inner.move_to_outer(b, c)
        assert b2 is b and c2 is c


def test_move_to_outer_pattern_for_loop_accumulator() -> None:
    """TorchSharp memory.md: an accumulator updated in an inner scope is moved out each step."""
    with ts.scope() as d0:
        total = torch.zeros(4)
        for _ in range(3):
            with ts.scope():
                x = torch.ones(4)
                total = (total + x.exp()).move_to_outer()
            assert x.is_disposed
            assert total.scope is d0
        assert torch.allclose(total, torch.full((4,), 3 * math.e))
    assert total.is_disposed


# --------------------------------------------------------------------------------------------
# detach_from_scope / exclude
# --------------------------------------------------------------------------------------------


def test_detach_from_scope_survives_every_scope() -> None:
    """A detached ref is owned by no scope and lives until the user drops or disposes it."""
    with ts.scope() as s1, ts.scope() as s2:
        t = torch.randn(2)
        assert t.detach_from_scope() is t
        assert t.scope is None
        assert t not in s2 and t not in s1
    assert not t.is_disposed
    assert usable(t)
    t.dispose()
    assert t.is_disposed


def test_detach_from_scope_of_unowned_is_noop() -> None:
    """Detaching an unowned ref changes nothing."""
    u = ts.ref(torch.randn(2))
    assert u.detach_from_scope() is u
    assert u.scope is None
    assert not u.is_disposed


def test_detach_is_still_autograds_detach() -> None:
    """``detach()`` keeps its torch meaning: a new ref owned by the scope, cut from autograd."""
    w = torch.randn(3, requires_grad=True)
    with ts.scope() as s:
        y = w * 2
        d = y.detach()
        assert d is not y
        assert not d.requires_grad
        assert d.scope is s  # not detached from the scope


def test_exclude_gives_up_ownership() -> None:
    """``s.exclude`` detaches refs it owns and returns its argument(s)."""
    with ts.scope() as s:
        a = torch.randn(2)
        b = torch.randn(2)
        c = torch.randn(2)
        assert s.exclude(a) is a
        b2, c2 = s.exclude(b, c)
        assert b2 is b and c2 is c
        assert a.scope is None and b.scope is None and c.scope is None
        assert len(s) == 0
    assert not a.is_disposed and not b.is_disposed and not c.is_disposed


def test_exclude_ignores_refs_owned_elsewhere() -> None:
    """``s.exclude`` of a ref that ``s`` does not own leaves the ref with its owner."""
    u = ts.ref(torch.randn(2))
    with ts.scope() as s1:
        a = torch.randn(2)
        with ts.scope() as s2:
            s2.exclude(a, u)
            assert a.scope is s1
            assert u.scope is None
    assert a.is_disposed
    assert not u.is_disposed


# --------------------------------------------------------------------------------------------
# include (TorchSharp Attach)
# --------------------------------------------------------------------------------------------


def test_include_adopts_unowned_ref() -> None:
    """An unowned ref included in a scope is disposed with it."""
    u = ts.ref(torch.randn(2))
    with ts.scope() as s:
        assert s.include(u) is u
        assert u.scope is s
        assert u in s
    assert u.is_disposed


def test_include_moves_ref_from_other_scope() -> None:
    """A ref owned by another scope moves to the including scope."""
    with ts.scope() as s1:
        b = torch.randn(2)
        with ts.scope() as s2:
            assert s2.include(b) is b
            assert b.scope is s2
            assert b not in s1
        assert b.is_disposed
        assert len(s1) == 0


def test_include_into_outer_scope() -> None:
    """A scope may include a ref while an inner scope is current (it need not be current)."""
    with ts.scope() as s1, ts.scope() as s2:
        t = torch.randn(2)
        s1.include(t)
        assert t.scope is s1
        assert t not in s2
    assert t.is_disposed


def test_include_of_owned_ref_is_noop() -> None:
    """Including a ref the scope already owns changes nothing."""
    with ts.scope() as s:
        t = torch.randn(2)
        assert s.include(t) is t
        assert t.scope is s
        assert len(s) == 1


def test_include_wraps_plain_tensor() -> None:
    """A plain tensor is wrapped first; the wrapping ref is returned and owned."""
    p = torch.randn(2)
    with ts.scope() as s:
        r = s.include(p)
        assert isinstance(r, ts.TensorRef)
        assert r.scope is s
        assert r in s
        assert r.data_ptr() == p.data_ptr() or r is p
    assert r.is_disposed


def test_include_returns_tuple_for_several() -> None:
    """Several arguments come back as a tuple, in order."""
    u = ts.ref(torch.randn(2))
    v = ts.ref(torch.randn(2))
    with ts.scope() as s:
        a, b = s.include(u, v)
        assert a is u and b is v
        assert len(s) == 2


# --------------------------------------------------------------------------------------------
# move_to_scope (TorchSharp MoveToOtherDisposeScope)
# --------------------------------------------------------------------------------------------


def test_move_to_scope_between_scopes() -> None:
    """A ref can move to any open scope of the stack, inner or outer."""
    with ts.scope() as s1:
        t = torch.randn(2)
        with ts.scope() as s2:
            assert t.move_to_scope(s2) is t
            assert t.scope is s2
            u = torch.randn(2)
            u.move_to_scope(s1)
            assert u.scope is s1
        assert t.is_disposed
        assert not u.is_disposed
    assert u.is_disposed


def test_move_to_scope_none_detaches() -> None:
    """``move_to_scope(None)`` leaves the ref unowned."""
    with ts.scope():
        t = torch.randn(2).move_to_scope(None)
        assert t.scope is None
    assert not t.is_disposed


def test_move_to_scope_attaches_unowned() -> None:
    """``move_to_scope(s)`` of an unowned ref attaches it to ``s``."""
    u = ts.ref(torch.randn(2))
    with ts.scope() as s:
        u.move_to_scope(s)
        assert u in s
    assert u.is_disposed


def test_move_to_closed_scope_raises() -> None:
    """Moving into a closed scope is a ScopeError and leaves the ref where it was."""
    with ts.scope() as closed:
        pass
    with ts.scope() as s:
        t = torch.randn(2)
        with pytest.raises(ts.ScopeError):
            t.move_to_scope(closed)
        assert t.scope is s


# --------------------------------------------------------------------------------------------
# dispose_everything / dispose_everything_but
# --------------------------------------------------------------------------------------------


def test_dispose_everything_keeps_scope_open() -> None:
    """``dispose_everything`` disposes all owned refs now; the scope stays usable."""
    u = ts.ref(torch.randn(2))
    with ts.scope() as s:
        a = torch.randn(2)
        b = torch.randn(2)
        s.dispose_everything()
        assert a.is_disposed and b.is_disposed
        assert len(s) == 0
        assert not s.is_closed
        assert not u.is_disposed  # not owned
        c = torch.randn(2)
        assert c in s
    assert c.is_disposed


def test_dispose_everything_but_accepts_iterables() -> None:
    """``keep`` may hold tensors or iterables of tensors; the call returns ``keep``."""
    with ts.scope() as s:
        a, b, c, d = (torch.randn(2) for _ in range(4))
        kept = [a, b]
        assert s.dispose_everything_but(kept) is kept
        assert not a.is_disposed and not b.is_disposed
        assert c.is_disposed and d.is_disposed

        e = torch.randn(2)
        result = s.dispose_everything_but(a, (e,))
        assert isinstance(result, tuple)
        assert result[0] is a
        assert b.is_disposed
        assert not a.is_disposed and not e.is_disposed
        assert a in s and e in s  # kept refs stay owned and die at close
    assert a.is_disposed and e.is_disposed


def test_dispose_everything_but_never_adopts_keep() -> None:
    """Refs in ``keep`` that the scope does not own are left alone."""
    u = ts.ref(torch.randn(2))
    with ts.scope() as s1:
        a = torch.randn(2)
        with ts.scope() as s2:
            b = torch.randn(2)
            s2.dispose_everything_but(a, u)
            assert b.is_disposed
            assert a.scope is s1
            assert u.scope is None
            assert len(s2) == 0
        assert not a.is_disposed
    assert not u.is_disposed


def test_dispose_everything_but_nothing() -> None:
    """With no argument it disposes everything the scope owns."""
    with ts.scope() as s:
        a = torch.randn(2)
        assert s.dispose_everything_but() == ()
        assert a.is_disposed


def test_module_level_dispose_everything_acts_on_current_scope() -> None:
    """``ts.dispose_everything()`` and ``ts.dispose_everything_but()`` use the current scope."""
    with ts.scope() as s1:
        a = torch.randn(2)
        with ts.scope() as s2:
            b = torch.randn(2)
            c = torch.randn(2)
            assert ts.dispose_everything_but(c) is c
            assert b.is_disposed
            assert not c.is_disposed
            assert not a.is_disposed
            ts.dispose_everything()
            assert c.is_disposed
            assert not a.is_disposed
            assert not s2.is_closed
        assert a in s1


def test_module_level_dispose_everything_without_scope_raises() -> None:
    """No scope open: the module-level functions raise ScopeError."""
    u = ts.ref(torch.randn(2))
    with pytest.raises(ts.ScopeError):
        ts.dispose_everything()
    with pytest.raises(ts.ScopeError):
        ts.dispose_everything_but(u)
    assert not u.is_disposed


# --------------------------------------------------------------------------------------------
# Disposing single refs
# --------------------------------------------------------------------------------------------


def test_dispose_is_idempotent() -> None:
    """``t.dispose()`` and ``ts.dispose(...)`` may be called any number of times."""
    with ts.scope() as s:
        a = torch.randn(2)
        b = torch.randn(2)
        c = torch.randn(2)
        a.dispose()
        a.dispose()
        ts.dispose(b, c)
        ts.dispose(a, b, c)
        assert a.is_disposed and b.is_disposed and c.is_disposed
        assert len(s) == 0
    a.dispose()
    u = ts.ref(torch.randn(2))
    ts.dispose(u)
    ts.dispose(u)
    assert u.is_disposed


def test_disposed_ref_leaves_its_scope() -> None:
    """A disposed ref is no longer owned: not ``in`` its scope, not counted, not tracked."""
    with ts.scope() as s:
        a = torch.randn(2)
        b = torch.randn(2)
        a.dispose()
        assert a not in s
        assert len(s) == 1
        assert not contains(s.tracked(), a)
        assert contains(s.tracked(), b)


def test_dispose_ref_owned_by_outer_scope_from_inner() -> None:
    """A ref may be disposed while another scope is current."""
    with ts.scope() as s1:
        a = torch.randn(2)
        with ts.scope():
            a.dispose()
        assert a.is_disposed
        assert a not in s1


def test_disposed_ref_cannot_be_moved() -> None:
    """Moving or adopting a disposed ref raises DisposedTensorError."""
    with ts.scope() as s1, ts.scope() as s2:
        t = torch.randn(2)
        t.dispose()
        with pytest.raises(ts.DisposedTensorError):
            s1.include(t)
        with pytest.raises(ts.DisposedTensorError):
            t.move_to_scope(s1)
        with pytest.raises(ts.DisposedTensorError):
            t.move_to_outer()
        with pytest.raises(ts.DisposedTensorError):
            t.detach_from_scope()
        assert t not in s1 and t not in s2
        assert t.is_disposed


# --------------------------------------------------------------------------------------------
# close(), with-exit, re-entry, out-of-order close
# --------------------------------------------------------------------------------------------


def test_close_is_idempotent_and_with_exit_after_close_is_noop() -> None:
    """``close()`` twice is fine, and leaving the ``with`` block after it does nothing more."""
    with ts.scope() as s:
        t = torch.randn(2)
        s.close()
        assert s.is_closed
        assert t.is_disposed
        s.close()
        assert ts.current_scope() is None
        u = torch.randn(2)  # no scope open any more: a plain tensor
        assert type(u) is torch.Tensor
    assert s.is_closed
    assert ts.current_scope() is None


def test_closing_innermost_inside_with_makes_outer_current() -> None:
    """Closing the current scope early makes its outer current again."""
    with ts.scope() as s1:
        with ts.scope() as s2:
            s2.close()
            assert ts.current_scope() is s1
            t = torch.randn(2)
            assert t.scope is s1
        assert ts.current_scope() is s1
        assert not t.is_disposed
    assert t.is_disposed


def test_reentering_closed_scope_raises() -> None:
    """A closed scope cannot be entered again."""
    with ts.scope() as s:
        pass
    with pytest.raises(ts.ScopeError), s:
        pass
    assert ts.current_scope() is None


def test_entering_open_scope_twice_raises() -> None:
    """Entering the same scope twice raises ScopeError; the scope stays usable."""
    s = ts.scope()
    with s:
        with pytest.raises(ts.ScopeError), s:
            pass
        assert ts.current_scope() is s
        t = torch.randn(2)
        assert t.scope is s
    assert t.is_disposed
    assert ts.current_scope() is None


def test_out_of_order_close_relinks_inner_scope() -> None:
    """Closing an outer scope first disposes its refs; the inner stays open, relinked outward."""
    with ts.scope() as s1:
        a = torch.randn(2)
        with ts.scope() as s2:
            b = torch.randn(2)
            s1.close()
            assert s1.is_closed
            assert a.is_disposed
            assert not s2.is_closed
            assert not b.is_disposed
            assert s2.outer is None
            assert ts.current_scope() is s2
            c = torch.randn(2)
            assert c.scope is s2
            d = torch.randn(2).move_to_outer()  # the outer is gone: unowned
            assert d.scope is None
        assert b.is_disposed and c.is_disposed
        assert not d.is_disposed
        assert ts.current_scope() is None
    assert ts.current_scope() is None
    assert not d.is_disposed


def test_out_of_order_close_of_middle_scope() -> None:
    """Closing the middle of three scopes relinks the innermost to the outermost."""
    with ts.scope() as s1:
        with ts.scope() as s2:
            m = torch.randn(2)
            with ts.scope() as s3:
                s2.close()
                assert m.is_disposed
                assert s3.outer is s1
                assert ts.current_scope() is s3
                t = torch.randn(2).move_to_outer()
                assert t.scope is s1
            assert ts.current_scope() is s1
        assert ts.current_scope() is s1
        assert not t.is_disposed
    assert t.is_disposed


def test_scope_entered_and_closed_by_hand() -> None:
    """``__enter__`` returns the scope; ``close()`` without ``__exit__`` also pops it."""
    s = ts.scope(name="manual")
    assert s.__enter__() is s
    assert ts.current_scope() is s
    t = torch.randn(2)
    s.close()
    assert t.is_disposed
    assert ts.current_scope() is None


CLOSED_SCOPE_MISUSES = {
    "len": lambda s, t: len(s),
    "tracked": lambda s, t: s.tracked(),
    "outer": lambda s, t: s.outer,
    "include": lambda s, t: s.include(t),
    "exclude": lambda s, t: s.exclude(t),
    "move_to_outer": lambda s, t: s.move_to_outer(t),
    "dispose_everything": lambda s, t: s.dispose_everything(),
    "dispose_everything_but": lambda s, t: s.dispose_everything_but(t),
}


@pytest.mark.parametrize("use", list(CLOSED_SCOPE_MISUSES.values()), ids=list(CLOSED_SCOPE_MISUSES))
def test_closed_scope_members_raise(use) -> None:
    """Members other than close(), is_closed, ``in`` and name raise ScopeError once closed."""
    with ts.scope() as s:
        pass
    u = ts.ref(torch.randn(2))
    with pytest.raises(ts.ScopeError):
        use(s, u)
    assert u.scope is None
    assert not u.is_disposed


def test_closed_scope_allowed_members() -> None:
    """close(), is_closed, ``in`` and name keep working on a closed scope."""
    with ts.scope(name="done") as s:
        t = torch.randn(2)
    s.close()
    assert s.is_closed
    assert s.name == "done"
    assert t not in s
    assert ts.ref(torch.randn(2)) not in s


# --------------------------------------------------------------------------------------------
# Membership, len, tracked
# --------------------------------------------------------------------------------------------


def test_membership_is_by_identity_never_equality() -> None:
    """``t in s`` never compares values: equal tensors are not members, and nothing raises."""
    u = ts.ref(torch.zeros(3))
    p = torch.zeros(3)
    with ts.scope() as s:
        a = torch.zeros(3)
        b = torch.zeros(3)
        assert a in s and b in s
        assert u not in s  # same values, not owned
        assert p not in s  # a plain tensor
        assert a.view(3) in s  # a view is its own (owned) ref
        a_alias = a
        assert a_alias in s


def test_len_and_tracked_snapshot() -> None:
    """``len(s)`` counts owned live refs; ``tracked()`` is a snapshot list of them."""
    with ts.scope() as s:
        assert len(s) == 0
        assert s.tracked() == []
        a = torch.randn(2)
        b = torch.randn(2)
        snap = s.tracked()
        assert isinstance(snap, list)
        assert len(snap) == 2 == len(s)
        assert contains(snap, a) and contains(snap, b)
        c = torch.randn(2)
        assert len(s) == 3
        assert len(snap) == 2  # a snapshot, not a live view
        assert not contains(snap, c)
        snap.clear()  # changing the snapshot does not change the scope
        assert len(s) == 3
        assert all(isinstance(t, ts.TensorRef) for t in s.tracked())


# --------------------------------------------------------------------------------------------
# ts.ref
# --------------------------------------------------------------------------------------------


def test_ref_outside_scope_is_unowned() -> None:
    """``ts.ref`` outside any scope makes an unowned ref of the same object."""
    t = torch.randn(2)
    r = ts.ref(t)
    assert r is t
    assert isinstance(r, ts.TensorRef)
    assert r.scope is None
    assert not r.is_disposed
    assert ts.ref(r) is r


def test_ref_inside_scope_is_owned() -> None:
    """``ts.ref`` of a plain tensor inside a scope converts it in place, owned by the scope."""
    t = torch.arange(4.0)
    with ts.scope() as s:
        r = ts.ref(t)
        assert r is t
        assert r.scope is s
        assert ts.ref(r) is r
    assert t.is_disposed


def test_ref_of_ref_keeps_owner() -> None:
    """``ts.ref`` of a ref returns it unchanged, whichever scope is current."""
    with ts.scope() as s1:
        a = torch.randn(2)
        with ts.scope():
            assert ts.ref(a) is a
            assert a.scope is s1
