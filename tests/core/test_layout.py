"""The layout the C++ engine and Python share (tensorscope/_layout.py): the engine's compiled-in
layout is the declared one, the declared names are those of the Python objects the engine
reads and writes, and an engine built from other sources is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import tensorscope
from tensorscope import _engine, _layout
from tensorscope._engine import FAST
from tensorscope._intercept import Interceptor
from tensorscope._state import Counters, RefState
from tensorscope._thread import ThreadState
from tensorscope.residency import native
from tensorscope.scope import DisposeScope

pytestmark = pytest.mark.engine_independent  # reads layouts and classes; opens no scope


@pytest.mark.skipif(FAST is None, reason="the C++ engine is not loaded (TENSORSCOPE_ENGINE)")
def test_the_engine_was_compiled_with_the_declared_layout() -> None:
    assert FAST.layout() == _layout.LAYOUT


def test_the_declared_names_are_those_of_the_python_objects() -> None:
    ref_slots, _, counter_slots = (
        tuple(part.split()) for part in " ".join(_layout.REF_STATE).partition("|")
    )
    assert set(ref_slots) <= set(RefState.__slots__)
    assert set(counter_slots) <= set(Counters.__slots__)
    pending, counters, closed, owned, state, alive = _layout.ATTRIBUTES
    thread = ThreadState()
    assert hasattr(thread, pending) and hasattr(thread, counters) and hasattr(thread, alive)
    scope = DisposeScope()  # made, never entered
    assert hasattr(scope, closed) and hasattr(scope, owned)
    assert getattr(Interceptor(thread), state) is thread


def test_counters_are_read_by_their_declared_index() -> None:
    if native.ENGINE is None:
        assert native.counters() == (0, 0)
        return
    fast, slow = native.counters()
    assert native.ENGINE.res_counter(_layout.FAST_OPS, 0) == fast
    assert native.ENGINE.res_counter(_layout.SLOW_OPS, 0) == slow
    with pytest.raises(ValueError, match="no counter"):
        native.ENGINE.res_counter(len(_layout.COUNTERS), 0)


def test_an_engine_built_from_other_sources_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORSCOPE_ENGINE", raising=False)
    stale = SimpleNamespace(__file__="_fast.so", layout=lambda: {"counters": ("pending",)})
    monkeypatch.setattr(tensorscope, "_fast", stale, raising=False)
    with pytest.raises(ImportError, match=r"built from other sources.*Rebuild"):
        _engine._load()
    older = SimpleNamespace(__file__="_fast.so")  # from before the layout was exported
    monkeypatch.setattr(tensorscope, "_fast", older, raising=False)
    with pytest.raises(ImportError, match="TENSORSCOPE_ENGINE=python"):
        _engine._load()
    current = SimpleNamespace(__file__="_fast.so", layout=lambda: dict(_layout.LAYOUT))
    monkeypatch.setattr(tensorscope, "_fast", current, raising=False)
    assert _engine._load() is current
