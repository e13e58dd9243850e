"""Random programs of scope operations, checked step by step against a pure-Python model.

The model knows, for every ref the program holds, its owner (an open scope or None) and whether
it is disposed, plus the stack of open scopes and the expected ``ts.stats()`` counters (API.md
§3). After every step it checks ``ts.current_scope()``, each open scope's ``outer``, ``len`` and
``tracked()``, every ref's ``is_disposed`` and ``scope``, ``t in s`` for every pair, and all
counters.

Refs are kept in a dict under integer handles (never in Hypothesis bundles, which would keep
them alive), so the "drop" step really releases the last reference. All refs come from
``torch.randn`` (or ``ts.ref`` outside a scope) and ``t * 2``: no views and no autograd, so each
op makes exactly one ref and nothing else holds them.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import tensorscope as ts

from ._support import COUNTERS, close_leftover_scopes, snapshot

MAX_OPEN = 4


def returned_as(result: Any, given: list[torch.Tensor]) -> bool:
    """Methods taking ``*tensors`` return the tensor for one argument, else a tuple."""
    if len(given) == 1:
        return result is given[0]
    return (
        isinstance(result, tuple)
        and len(result) == len(given)
        and all(r is g for r, g in zip(result, given, strict=True))
    )


class ScopeProgram(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        ts.reset_stats()
        self.open: list[Any] = []  # open scopes, outermost first (the model's stack)
        self.closed: list[Any] = []
        self.tensors: dict[int, torch.Tensor] = {}  # the only strong references
        self.owner: dict[int, Any] = {}  # handle -> owning scope or None (live refs)
        self.disposed: set[int] = set()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.next_handle = 0

    # ---- model helpers ----------------------------------------------------------------------

    def live(self) -> list[int]:
        return [h for h in self.tensors if h not in self.disposed]

    def has_live(self) -> bool:
        return bool(self.live())

    def index_of(self, scope: Any) -> int:
        return next(i for i, s in enumerate(self.open) if s is scope)

    def outer_of(self, scope: Any) -> Any:
        i = self.index_of(scope)
        return self.open[i - 1] if i else None

    def add(self, t: torch.Tensor, owner: Any) -> None:
        assert isinstance(t, ts.TensorRef)
        self.tensors[self.next_handle] = t
        self.owner[self.next_handle] = owner
        self.counts["created_in_scope" if owner is not None else "created_outside_scope"] += 1
        self.next_handle += 1

    def mark_disposed(self, h: int) -> None:
        if h in self.disposed:
            return  # a second dispose counts nothing
        inside = self.owner[h] is not None
        self.counts["disposed_in_scope" if inside else "disposed_outside_scope"] += 1
        self.disposed.add(h)
        self.owner[h] = None

    def move(self, h: int, target: Any, *, attach_counts_from_scope: bool = False) -> None:
        """Model a move of live ref ``h`` to ``target`` (a scope or None)."""
        current = self.owner[h]
        if current is target:
            return
        if target is None:
            self.counts["detached"] += 1
        elif current is None or attach_counts_from_scope:
            self.counts["attached"] += 1
        self.owner[h] = target

    def draw_live(self, data: st.DataObject, label: str = "t") -> int:
        return data.draw(st.sampled_from(self.live()), label=label)

    def draw_live_many(self, data: st.DataObject, min_size: int = 1) -> list[int]:
        return data.draw(
            st.lists(st.sampled_from(self.live()), min_size=min_size, max_size=3, unique=True),
            label="ts",
        )

    def draw_open(self, data: st.DataObject) -> Any:
        return data.draw(st.sampled_from(self.open), label="scope")

    # ---- scopes -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.open) < MAX_OPEN)
    @rule()
    def open_scope(self) -> None:
        s = ts.scope(name=f"s{len(self.open) + len(self.closed)}")
        assert s.__enter__() is s
        self.open.append(s)

    @precondition(lambda self: self.open)
    @rule(data=st.data(), via_exit=st.booleans())
    def close_scope(self, data: st.DataObject, via_exit: bool) -> None:
        """Close any open scope, out of LIFO order too; the innermost may also leave by __exit__."""
        s = self.draw_open(data)
        if via_exit and s is self.open[-1]:
            assert s.__exit__(None, None, None) in (None, False)
        else:
            s.close()
        for h in self.live():
            if self.owner[h] is s:
                self.mark_disposed(h)
        del self.open[self.index_of(s)]
        self.closed.append(s)

    @precondition(lambda self: self.closed)
    @rule(data=st.data())
    def close_again(self, data: st.DataObject) -> None:
        data.draw(st.sampled_from(self.closed), label="closed").close()

    @precondition(lambda self: self.closed and self.has_live())
    @rule(data=st.data())
    def misuse_closed_scope(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self.closed), label="closed")
        t = self.tensors[self.draw_live(data)]
        with pytest.raises(ts.ScopeError):
            s.include(t)
        with pytest.raises(ts.ScopeError):
            t.move_to_scope(s)

    # ---- creating refs ----------------------------------------------------------------------

    @rule(via_ref=st.booleans())
    def create(self, via_ref: bool) -> None:
        if self.open:
            t = torch.randn(2)
            if via_ref:
                assert ts.ref(t) is t
            self.add(t, self.open[-1])
        else:
            self.add(ts.ref(torch.randn(2)), None)

    @precondition(lambda self: self.open and self.has_live())
    @rule(data=st.data())
    def derive(self, data: st.DataObject) -> None:
        """An op on any live ref makes a new ref of the innermost scope."""
        source = self.tensors[self.draw_live(data)]
        self.add(source * 2, self.open[-1])

    # ---- moving refs ------------------------------------------------------------------------

    @precondition(lambda self: self.has_live())
    @rule(data=st.data())
    def ref_move_to_outer(self, data: st.DataObject) -> None:
        h = self.draw_live(data)
        assert self.tensors[h].move_to_outer() is self.tensors[h]
        if self.owner[h] is not None:
            self.move(h, self.outer_of(self.owner[h]))

    @precondition(lambda self: self.open and self.has_live())
    @rule(data=st.data())
    def scope_move_to_outer(self, data: st.DataObject) -> None:
        s = self.draw_open(data)
        hs = self.draw_live_many(data)
        given = [self.tensors[h] for h in hs]
        assert returned_as(s.move_to_outer(*given), given)
        for h in hs:
            if self.owner[h] is s:
                self.move(h, self.outer_of(s))

    @precondition(lambda self: self.has_live())
    @rule(data=st.data(), how=st.sampled_from(["detach_from_scope", "move_to_scope(None)"]))
    def detach(self, data: st.DataObject, how: str) -> None:
        h = self.draw_live(data)
        t = self.tensors[h]
        result = t.detach_from_scope() if how == "detach_from_scope" else t.move_to_scope(None)
        assert result is t
        self.move(h, None)

    @precondition(lambda self: self.open and self.has_live())
    @rule(data=st.data())
    def include(self, data: st.DataObject) -> None:
        s = self.draw_open(data)
        hs = self.draw_live_many(data)
        given = [self.tensors[h] for h in hs]
        assert returned_as(s.include(*given), given)
        for h in hs:
            self.move(h, s, attach_counts_from_scope=True)

    @precondition(lambda self: self.open and self.has_live())
    @rule(data=st.data())
    def exclude(self, data: st.DataObject) -> None:
        s = self.draw_open(data)
        hs = self.draw_live_many(data)
        given = [self.tensors[h] for h in hs]
        assert returned_as(s.exclude(*given), given)
        for h in hs:
            if self.owner[h] is s:
                self.move(h, None)

    @precondition(lambda self: self.open and self.has_live())
    @rule(data=st.data())
    def move_to_scope(self, data: st.DataObject) -> None:
        s = self.draw_open(data)
        h = self.draw_live(data)
        assert self.tensors[h].move_to_scope(s) is self.tensors[h]
        self.move(h, s)

    # ---- disposing --------------------------------------------------------------------------

    @precondition(lambda self: self.tensors)
    @rule(data=st.data(), via_module=st.booleans())
    def dispose(self, data: st.DataObject, via_module: bool) -> None:
        """Dispose refs, live or already disposed (idempotent)."""
        hs = data.draw(
            st.lists(st.sampled_from(sorted(self.tensors)), min_size=1, max_size=3, unique=True),
            label="ts",
        )
        if via_module:
            ts.dispose(*(self.tensors[h] for h in hs))
        else:
            for h in hs:
                self.tensors[h].dispose()
        for h in hs:
            self.mark_disposed(h)

    @precondition(lambda self: self.open)
    @rule(data=st.data(), via_module=st.booleans())
    def dispose_everything(self, data: st.DataObject, via_module: bool) -> None:
        if via_module:
            s = self.open[-1]
            ts.dispose_everything()
        else:
            s = self.draw_open(data)
            s.dispose_everything()
        for h in self.live():
            if self.owner[h] is s:
                self.mark_disposed(h)

    @precondition(lambda self: self.open)
    @rule(
        data=st.data(),
        via_module=st.booleans(),
        form=st.sampled_from(["args", "list"]),
    )
    def dispose_everything_but(self, data: st.DataObject, via_module: bool, form: str) -> None:
        s = self.open[-1] if via_module else self.draw_open(data)
        keep = self.draw_live_many(data, min_size=0) if self.has_live() else []
        kept = [self.tensors[h] for h in keep]
        call = ts.dispose_everything_but if via_module else s.dispose_everything_but
        if form == "list":
            assert call(kept) is kept
        elif len(kept) == 1:
            assert call(*kept) is kept[0]
        else:
            result = call(*kept)
            assert isinstance(result, tuple)
            assert all(r is k for r, k in zip(result, kept, strict=True))
        del kept
        for h in self.live():
            if self.owner[h] is s and h not in keep:
                self.mark_disposed(h)

    @precondition(lambda self: self.tensors)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """Drop the last Python reference: a live ref is freed and counts as disposed."""
        h = data.draw(st.sampled_from(sorted(self.tensors)), label="t")
        t = self.tensors.pop(h)
        alive = weakref.ref(t)
        del t
        if alive() is not None:
            gc.collect()
        assert alive() is None, "a dropped ref is still alive: scopes must hold weak references"
        self.mark_disposed(h)
        self.disposed.discard(h)
        del self.owner[h]

    # ---- checks -----------------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        assert ts.current_scope() is (self.open[-1] if self.open else None)
        recent_closed = self.closed[-4:]
        for i, s in enumerate(self.open):
            assert not s.is_closed
            assert s.outer is (self.open[i - 1] if i else None)
            owned = {id(self.tensors[h]) for h in self.live() if self.owner[h] is s}
            assert len(s) == len(owned)
            assert {id(t) for t in s.tracked()} == owned
        for s in recent_closed:
            assert s.is_closed
        for h, t in self.tensors.items():
            disposed = h in self.disposed
            assert t.is_disposed is disposed
            if not disposed:
                assert t.scope is self.owner[h]
            for s in (*self.open, *recent_closed):
                assert (t in s) is (not disposed and self.owner[h] is s)
        expected = dict(self.counts)
        expected["live"] = (
            expected["created_in_scope"]
            + expected["created_outside_scope"]
            - expected["disposed_in_scope"]
            - expected["disposed_outside_scope"]
        )
        assert snapshot() == expected

    def teardown(self) -> None:
        while self.open:
            self.open.pop().close()
        close_leftover_scopes()  # only does something if the implementation disagreed
        for t in self.tensors.values():
            t.dispose()
        self.tensors.clear()


def test_random_scope_programs() -> None:
    """Random scope programs agree with the ownership model at every step."""
    gc.collect()  # nothing left over from earlier tests may be freed (and counted) mid-program
    run_state_machine_as_test(
        ScopeProgram,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
