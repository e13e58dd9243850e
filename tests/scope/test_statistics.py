"""``ts.stats()`` counters (API.md §3).

Ports TorchSharp's TestDisposeScopesStatisticsTensor.cs (scoped) and
TestDisposeScopesStatisticsTensorUnscoped.cs to tensorscope's semantics, then covers the rest of
§3: moves, include, refs freed by Python, views, in-place ops, snapshots and threads.

Exact counts only use tensors that do not require grad, and ops that create exactly one ref each
(``torch.randn``, ``x + y``, ``x * 2``, ``x.sum()``, ``x[0]``). Outside a scope an unowned ref is
made with ``ts.ref`` (plain tensors are never counted).
"""

from __future__ import annotations

import dataclasses
import gc
import threading

import pytest
import torch
from torch import nn

import tensorscope as ts

from ._support import FIELDS, snapshot

pytestmark = pytest.mark.usefixtures("stats")


def unowned() -> torch.Tensor:
    """One unowned ref (counts one ``created_outside_scope`` when no scope is open)."""
    return ts.ref(torch.zeros(()))


# --------------------------------------------------------------------------------------------
# TorchSharp: TestDisposeScopesStatisticsTensorScoped
# --------------------------------------------------------------------------------------------


def test_creating_increments_created_in_scope_once(stats) -> None:
    """TorchSharp: CreatingIncrementsCreatedInScopeOnce."""
    with ts.scope():
        t = torch.randn(())
        stats(created_in_scope=1, live=1)
    assert t.is_disposed


def test_attaching_to_scope_already_attached_to_increments_nothing(stats) -> None:
    """TorchSharp: AttachingToScopeAlreadyAttachedToIncrementsNothing."""
    with ts.scope() as scope:
        t = torch.randn(())
        scope.include(t)
        stats(created_in_scope=1)


def test_detaching_increments_detached_once(stats) -> None:
    """TorchSharp: DetachingIncrementsDetachedOnce."""
    with ts.scope() as scope:
        t = torch.randn(())
        scope.exclude(t)
        stats(created_in_scope=1, detached=1)
        scope.exclude(t)  # no longer owned: ignored
        stats(created_in_scope=1, detached=1)


def test_disposing_increments_disposed_once(stats) -> None:
    """TorchSharp: DisposingIncrementsDisposedOnce."""
    with ts.scope():
        t = torch.randn(())
        t.dispose()
        stats(created_in_scope=1, disposed_in_scope=1, live=0)
        t.dispose()  # no re-entry
        stats(created_in_scope=1, disposed_in_scope=1, live=0)
    stats(created_in_scope=1, disposed_in_scope=1, live=0)


def test_disposing_scope_increments_disposed_once(stats) -> None:
    """TorchSharp: DisposingScopeIncrementsDisposedOnce."""
    with ts.scope() as scope:
        t = torch.randn(())
        scope.close()
        stats(created_in_scope=1, disposed_in_scope=1, live=0)
    t.dispose()
    del t
    gc.collect()
    stats(created_in_scope=1, disposed_in_scope=1, live=0)


def test_disposing_scope_after_detaching_does_nothing(stats) -> None:
    """TorchSharp: DisposingScopeAfterDetachingDoesNothing."""
    with ts.scope() as scope:
        t = torch.randn(())
        scope.exclude(t)
        scope.close()
        stats(created_in_scope=1, detached=1, live=1)
    assert not t.is_disposed


def test_parameter_created_from_scoped_tensor_only_counts_dispose_for_parameter(stats) -> None:
    """TorchSharp: ParameterCreatedFromScopedTensorOnlyCountsDisposeForParameter.

    Unlike TorchSharp, a scope never disposes a parameter (API.md §2), so the parameter survives
    both the disposal of the tensor it was made from and the scope. What making the parameter
    itself counts is left to the implementation; disposing ``t`` counts exactly once, and closing
    the scope disposes nothing more.
    """
    with ts.scope():
        t = torch.full((), 3.0)
        stats(created_in_scope=1)
        p = nn.Parameter(t)
        assert isinstance(p, nn.Parameter)
        before = snapshot()
        t.dispose()
        after = snapshot()
        assert after["disposed_in_scope"] == before["disposed_in_scope"] + 1
        assert after["disposed_outside_scope"] == before["disposed_outside_scope"]
        assert t.is_disposed
        assert not getattr(p, "is_disposed", False)
        assert p.item() == 3.0
    closed = snapshot()
    assert closed["disposed_in_scope"] == after["disposed_in_scope"]
    assert closed["disposed_outside_scope"] == after["disposed_outside_scope"]
    assert not getattr(p, "is_disposed", False)
    assert p.item() == 3.0


# --------------------------------------------------------------------------------------------
# TorchSharp: TestDisposeScopesStatisticsTensorUnscoped
# --------------------------------------------------------------------------------------------


def test_creating_increments_created_outside_scope(stats) -> None:
    """TorchSharp: CreatingIncrementsCreatedOutsideScope."""
    t = unowned()
    stats(created_outside_scope=1, live=1)
    assert not t.is_disposed


def test_attaching_increments_attached(stats) -> None:
    """TorchSharp: AttachingIncrementsAttached."""
    t = unowned()
    with ts.scope() as scope:
        scope.include(t)
        stats(created_outside_scope=1, attached=1, live=1)
    # owned by the scope when it closed: disposed in scope
    stats(created_outside_scope=1, attached=1, disposed_in_scope=1, live=0)


def test_detaching_increments_nothing_because_object_is_not_in_a_scope(stats) -> None:
    """TorchSharp: DetachingIncrementsNothingBecauseObjectIsNotInAScope."""
    t = unowned()
    with ts.scope() as scope:
        scope.exclude(t)
        t.detach_from_scope()
        t.move_to_scope(None)
        t.move_to_outer()
        stats(created_outside_scope=1, live=1)
    stats(created_outside_scope=1, live=1)


def test_disposing_increments_disposed_outside_scope(stats) -> None:
    """TorchSharp: DisposingIncrementsDisposedOutsideScope."""
    t = unowned()
    t.dispose()
    stats(created_outside_scope=1, disposed_outside_scope=1, live=0)
    t.dispose()  # no re-entry
    ts.dispose(t)
    stats(created_outside_scope=1, disposed_outside_scope=1, live=0)


def test_disposing_attached_increments_disposed_in_scope(stats) -> None:
    """TorchSharp: DisposingAttachedIncrementsDisposedInScope."""
    t = unowned()
    with ts.scope() as scope:
        scope.include(t)
        t.dispose()
        stats(created_outside_scope=1, disposed_in_scope=1, attached=1, live=0)


def test_disposing_scope_with_attached_increments_disposed(stats) -> None:
    """TorchSharp: DisposingScopeWithAttachedIncrementsDisposed."""
    t = unowned()
    with ts.scope() as scope:
        scope.include(t)
        scope.close()
        stats(created_outside_scope=1, disposed_in_scope=1, attached=1, live=0)
    assert t.is_disposed


def test_detaching_attached_increments_detached(stats) -> None:
    """TorchSharp: DetachingAttachedIncrementsDetached."""
    t = unowned()
    with ts.scope() as scope:
        scope.include(t)
        scope.exclude(t)
        stats(created_outside_scope=1, attached=1, detached=1, live=1)


def test_disposing_scope_after_detaching_does_nothing_unscoped(stats) -> None:
    """TorchSharp: DisposingScopeAfterDetachingDoesNothing (unscoped)."""
    t = unowned()
    with ts.scope() as scope:
        scope.include(t)
        scope.exclude(t)
        scope.close()
        stats(created_outside_scope=1, attached=1, detached=1, live=1)
    assert not t.is_disposed


def test_attach_again_is_same_as_move_to_other_and_stats_do_not_change(stats) -> None:
    """TorchSharp: AttachAgainIsSameAsMoveToOtherAndStatsDoNotChange."""
    t = unowned()
    with ts.scope() as scope:
        scope.include(t)
        with ts.scope() as scope2:
            stats(created_outside_scope=1, attached=1, live=1)
            t.move_to_scope(scope2)  # a move between two scopes counts nothing
            t.move_to_scope(scope)
            stats(created_outside_scope=1, attached=1, live=1)
        stats(created_outside_scope=1, attached=1, live=1)
        assert t.scope is scope


# --------------------------------------------------------------------------------------------
# Creation
# --------------------------------------------------------------------------------------------


def test_each_simple_op_creates_exactly_one_ref(stats) -> None:
    """randn, +, *, sum and indexing each count one ``created_in_scope``."""
    with ts.scope():
        x = torch.randn(4, 4)
        stats(created_in_scope=1)
        y = x + x
        stats(created_in_scope=2)
        z = y * 2
        stats(created_in_scope=3)
        total = z.sum()
        stats(created_in_scope=4)
        row = x[0]
        stats(created_in_scope=5)
        assert all(isinstance(t, ts.TensorRef) for t in (x, y, z, total, row))
    stats(created_in_scope=5, disposed_in_scope=5)


def test_plain_tensors_are_not_counted(stats) -> None:
    """With no scope open, torch ops make plain tensors, which are never counted."""
    x = torch.randn(4)
    y = (x + 1).sum()
    u = unowned()
    v = u + 1  # an op on a ref, outside any scope: a plain tensor
    stats(created_outside_scope=1)
    del x, y, v
    gc.collect()
    stats(created_outside_scope=1)
    assert not u.is_disposed


def test_ref_counts_created_where_it_is_made(stats) -> None:
    """``ts.ref`` counts ``created_outside_scope`` outside a scope, ``created_in_scope`` inside."""
    a = ts.ref(torch.zeros(2))
    stats(created_outside_scope=1)
    assert ts.ref(a) is a  # a ref again: nothing new
    stats(created_outside_scope=1)
    plain = torch.zeros(2)
    with ts.scope():
        b = ts.ref(plain)
        stats(created_outside_scope=1, created_in_scope=1)
        assert ts.ref(b) is b
        assert ts.ref(a) is a
        stats(created_outside_scope=1, created_in_scope=1)
    stats(created_outside_scope=1, created_in_scope=1, disposed_in_scope=1)


def test_temporaries_count_created_and_disposed(stats) -> None:
    """A temporary Python frees at once is created and disposed in scope."""
    with ts.scope() as s:
        x = torch.randn(3)
        y = (x * 2).sum()  # the product is a temporary
        stats(created_in_scope=3, disposed_in_scope=1)
        assert len(s) == 2
        assert not y.is_disposed


def test_views_count_one_ref_per_output(stats) -> None:
    """Views are new refs: one per output, also for split/chunk/unbind."""
    with ts.scope():
        x = torch.randn(6, 4)
        v = x.view(24)
        stats(created_in_scope=2)
        pieces = torch.split(x, 2)
        assert len(pieces) == 3
        stats(created_in_scope=5)
        chunks = x.chunk(2)
        stats(created_in_scope=7)
        rows = torch.unbind(x)
        assert len(rows) == 6
        stats(created_in_scope=13)
        assert all(isinstance(t, ts.TensorRef) for t in (v, *pieces, *chunks, *rows))


def test_in_place_ops_count_nothing(stats) -> None:
    """In-place ops (and ``out=``) return the same object and record nothing."""
    with ts.scope():
        x = torch.zeros(4)
        y = torch.ones(4)
        stats(created_in_scope=2)
        assert x.add_(1) is x
        assert x.mul_(y) is x
        x += 1
        assert torch.add(x, y, out=y) is y
        stats(created_in_scope=2)


# --------------------------------------------------------------------------------------------
# Moves
# --------------------------------------------------------------------------------------------


def test_move_between_scopes_counts_nothing(stats) -> None:
    """``move_to_outer`` into an enclosing scope and ``move_to_scope`` between scopes count 0."""
    with ts.scope() as s1, ts.scope() as s2:
        a = torch.randn(())
        b = torch.randn(())
        a.move_to_outer()
        s2.move_to_outer(b)
        b.move_to_scope(s2)
        b.move_to_scope(s2)  # already there
        stats(created_in_scope=2)
        assert a.scope is s1 and b.scope is s2


def test_move_out_of_outermost_counts_detached(stats) -> None:
    """Moving a ref out of the outermost scope counts one ``detached``."""
    with ts.scope() as s:
        a = torch.randn(()).move_to_outer()
        b = s.move_to_outer(torch.randn(()))
        stats(created_in_scope=2, detached=2)
        a.move_to_outer()  # unowned now: a no-op
        stats(created_in_scope=2, detached=2)
    stats(created_in_scope=2, detached=2)
    assert not a.is_disposed and not b.is_disposed


def test_detach_from_scope_and_move_to_none_count_detached(stats) -> None:
    """``detach_from_scope()`` and ``move_to_scope(None)`` of an owned ref count one each."""
    with ts.scope():
        a = torch.randn(()).detach_from_scope()
        b = torch.randn(()).move_to_scope(None)
        stats(created_in_scope=2, detached=2)
        a.detach_from_scope()
        b.move_to_scope(None)
        stats(created_in_scope=2, detached=2)


def test_move_to_scope_of_unowned_counts_attached(stats) -> None:
    """``move_to_scope(s)`` of an unowned ref counts one ``attached``."""
    t = unowned()
    with ts.scope() as s:
        t.move_to_scope(s)
        stats(created_outside_scope=1, attached=1)
        t.move_to_scope(s)
        stats(created_outside_scope=1, attached=1)
    stats(created_outside_scope=1, attached=1, disposed_in_scope=1)


def test_include_of_ref_owned_elsewhere_counts_attached(stats) -> None:
    """``include`` of a ref owned by another scope counts one ``attached`` (and no ``detached``)."""
    with ts.scope(), ts.scope() as inner:
        t = torch.randn(())
        with ts.scope() as innermost:
            t2 = torch.randn(())
            inner.include(t2)
            stats(created_in_scope=2, attached=1)
            innermost.include(t)
            stats(created_in_scope=2, attached=2)
            assert t.scope is innermost and t2.scope is inner


def test_out_of_order_close_counts_only_the_closed_scope(stats) -> None:
    """Closing an outer scope first disposes only its own refs."""
    with ts.scope() as s1:
        a = torch.randn(())
        with ts.scope():
            b = torch.randn(())
            s1.close()
            stats(created_in_scope=2, disposed_in_scope=1)
            b.move_to_outer()  # the closed outer is gone: out of the outermost
            stats(created_in_scope=2, disposed_in_scope=1, detached=1)
    stats(created_in_scope=2, disposed_in_scope=1, detached=1)
    assert a.is_disposed and not b.is_disposed


# --------------------------------------------------------------------------------------------
# Disposal
# --------------------------------------------------------------------------------------------


def test_dispose_everything_counts_each(stats) -> None:
    """``dispose_everything(_but)`` count one ``disposed_in_scope`` per disposed ref."""
    with ts.scope() as s:
        a, b, c = torch.randn(()), torch.randn(()), torch.randn(())
        s.dispose_everything_but(a)
        stats(created_in_scope=3, disposed_in_scope=2)
        s.dispose_everything()
        stats(created_in_scope=3, disposed_in_scope=3)
        ts.dispose(a, b, c)
        stats(created_in_scope=3, disposed_in_scope=3)


def test_dispose_counts_owner_at_that_moment(stats) -> None:
    """In/outside is decided by the owner when the ref is disposed, not where it was made."""
    with ts.scope():
        a = torch.randn(()).detach_from_scope()
    a.dispose()
    stats(created_in_scope=1, detached=1, disposed_outside_scope=1)
    b = unowned()
    with ts.scope() as s:
        s.include(b)
        b.dispose()
    stats(
        created_in_scope=1,
        created_outside_scope=1,
        detached=1,
        attached=1,
        disposed_outside_scope=1,
        disposed_in_scope=1,
    )


def test_python_freed_owned_ref_counts_disposed_in_scope(stats) -> None:
    """A ref Python frees inside its scope counts as disposed in scope."""
    with ts.scope() as s:
        t = torch.randn(())
        del t
        gc.collect()
        stats(created_in_scope=1, disposed_in_scope=1, live=0)
        assert len(s) == 0
    stats(created_in_scope=1, disposed_in_scope=1, live=0)


def test_python_freed_unowned_ref_counts_disposed_outside_scope(stats) -> None:
    """A ref Python frees while unowned counts as disposed outside scope."""
    t = unowned()
    del t
    gc.collect()
    stats(created_outside_scope=1, disposed_outside_scope=1, live=0)
    with ts.scope():
        u = torch.randn(()).detach_from_scope()
    del u
    gc.collect()
    stats(
        created_outside_scope=1,
        created_in_scope=1,
        detached=1,
        disposed_outside_scope=2,
        live=0,
    )


def test_python_freeing_a_disposed_ref_counts_nothing(stats) -> None:
    """Dropping the last reference to a disposed ref is not a second dispose."""
    with ts.scope():
        t = torch.randn(())
    stats(created_in_scope=1, disposed_in_scope=1)
    del t
    gc.collect()
    stats(created_in_scope=1, disposed_in_scope=1)


def test_python_freed_moved_ref_counts_owner_at_that_moment(stats) -> None:
    """A ref created in an inner scope and moved out is counted by the owner when freed."""
    with ts.scope():
        with ts.scope():
            t = torch.randn(()).move_to_outer()
        del t  # owned by the outer scope when Python frees it
        gc.collect()
        stats(created_in_scope=1, disposed_in_scope=1)


def test_live_counts_detached_refs_until_freed(stats) -> None:
    """``live`` = created - disposed: detached refs stay live until disposed or freed."""
    with ts.scope():
        keep = [torch.randn(()).detach_from_scope() for _ in range(3)]
        drop = [torch.randn(()) for _ in range(2)]
    stats(created_in_scope=5, disposed_in_scope=2, detached=3, live=3)
    assert all(t.is_disposed for t in drop)
    keep.pop().dispose()
    stats(created_in_scope=5, disposed_in_scope=2, detached=3, disposed_outside_scope=1, live=2)
    keep.clear()
    gc.collect()
    stats(created_in_scope=5, disposed_in_scope=2, detached=3, disposed_outside_scope=3, live=0)


# --------------------------------------------------------------------------------------------
# The snapshot and its scope of validity
# --------------------------------------------------------------------------------------------


def test_reset_stats_zeroes_all_counters(stats) -> None:
    """``ts.reset_stats()`` zeroes every counter of this thread."""
    u = unowned()
    with ts.scope() as s:
        a = torch.randn(())
        s.include(u)
        a.detach_from_scope()
        torch.randn(()).dispose()
        ts.reset_stats()
        assert snapshot() == dict.fromkeys(FIELDS, 0)


def test_stats_is_a_frozen_snapshot(stats) -> None:
    """``ts.stats()`` is an immutable snapshot: later events do not change it."""
    before = ts.stats()
    with ts.scope():
        t = torch.randn(())
        after = ts.stats()
    assert before.created_in_scope == 0 and before.live == 0
    assert after.created_in_scope == 1 and after.live == 1
    assert ts.stats().disposed_in_scope == 1
    assert after.disposed_in_scope == 0
    for name in FIELDS:
        assert isinstance(getattr(after, name), int)
    with pytest.raises((AttributeError, TypeError, dataclasses.FrozenInstanceError)):
        after.live = 5  # type: ignore[misc]
    assert t.is_disposed


def test_stats_are_per_thread(stats) -> None:
    """Each thread has its own counters: another thread's refs do not show up here."""
    seen: dict[str, dict[str, int]] = {}
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            ts.reset_stats()
            with ts.scope():
                a = torch.randn(())
                b = torch.randn(()).detach_from_scope()
                seen["inside"] = snapshot()
            seen["after"] = snapshot()
            del a, b
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    with ts.scope():
        mine = torch.randn(())
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        stats(created_in_scope=1)
    assert not errors, errors
    assert seen["inside"]["created_in_scope"] == 2
    assert seen["inside"]["detached"] == 1
    assert seen["after"]["disposed_in_scope"] == 1
    assert seen["after"]["live"] == 1
    stats(created_in_scope=1, disposed_in_scope=1)
    assert mine.is_disposed
