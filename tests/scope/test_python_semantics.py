"""Dispose scopes as a Python/PyTorch user meets them (API.md §1-2, §6).

Threads and asyncio tasks, the decorator form, weak references, exceptions, the
DisposedTensorError message, refs behaving like plain tensors (printing, numpy, torch.save,
pickle, deepcopy), views and in-place ops, grad modes and autograd, memory release, the leak
report, and tensors made from foreign memory (from_numpy, frombuffer).
"""

from __future__ import annotations

import asyncio
import copy
import gc
import io
import os
import pickle
import sys
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch import nn

import tensorscope as ts

FILE = os.path.basename(__file__)


def here() -> int:
    """The caller's current line: ``x, line = torch.randn(2), here()`` gives x's creation line."""
    return sys._getframe(1).f_lineno


def usable(t: torch.Tensor) -> bool:
    t.sum()
    return True


def run_in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a fresh thread and return its result (re-raising its exception)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result(timeout=30)


# --------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------


def test_scope_is_not_current_in_another_thread() -> None:
    """A scope opened in one thread neither is current in, nor owns tensors of, another."""
    with ts.scope() as s:
        x = torch.randn(2)

        def work() -> tuple[Any, torch.Tensor, torch.Tensor]:
            return ts.current_scope(), torch.randn(3), x + 1

        current, made, derived = run_in_thread(work)
        assert current is None
        # no scope open in that thread: plain tensors, even from an op on a ref
        assert type(made) is torch.Tensor
        assert type(derived) is torch.Tensor
        assert made not in s and derived not in s
        assert len(s) == 1
    assert x.is_disposed
    assert usable(made) and usable(derived)


def test_scope_opened_in_another_thread_does_not_capture_this_thread() -> None:
    """While a worker thread has a scope open, this thread still has none."""
    opened = threading.Event()
    release = threading.Event()

    def work() -> tuple[Any, torch.Tensor]:
        with ts.scope() as s:
            t = torch.randn(2)
            opened.set()
            assert release.wait(timeout=30)
        return s, t

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(work)
        assert opened.wait(timeout=30)
        assert ts.current_scope() is None
        mine = torch.randn(2)
        release.set()
        worker_scope, worker_tensor = future.result(timeout=30)
    assert type(mine) is torch.Tensor
    assert mine not in worker_scope
    assert worker_tensor.is_disposed


def test_threads_have_independent_scope_stacks() -> None:
    """Two threads interleaving inside their own scopes each own only their own tensors."""
    barrier = threading.Barrier(2, timeout=30)

    def work(name: str) -> dict[str, Any]:
        with ts.scope(name=name) as s:
            barrier.wait()
            a = torch.randn(2)
            barrier.wait()
            current = ts.current_scope()
            b = a * 2
            barrier.wait()
            result = {
                "scope": s,
                "outer": s.outer,
                "current": current,
                "owners": (a.scope, b.scope),
                "len": len(s),
                "tensors": (a, b),
            }
        return result

    with ts.scope() as main_scope, ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(work, name) for name in ("left", "right")]
        results = [f.result(timeout=30) for f in futures]
        assert len(main_scope) == 0
    left, right = results
    assert left["scope"] is not right["scope"]
    for r in results:
        assert r["outer"] is None  # not the main thread's scope
        assert r["current"] is r["scope"]
        assert r["owners"] == (r["scope"], r["scope"])
        assert r["len"] == 2
        assert all(t.is_disposed for t in r["tensors"])


# --------------------------------------------------------------------------------------------
# asyncio
# --------------------------------------------------------------------------------------------


def test_asyncio_tasks_have_independent_scopes() -> None:
    """Two tasks interleaving with ``await`` inside their scopes each own only their tensors."""
    events: list[tuple[str, str]] = []
    results: dict[str, dict[str, Any]] = {}

    async def task(name: str) -> None:
        with ts.scope(name=name) as s:
            events.append(("enter", name))
            await asyncio.sleep(0)
            a = torch.randn(2)
            await asyncio.sleep(0)
            current = ts.current_scope()
            b = a + 1
            await asyncio.sleep(0)
            results[name] = {
                "scope": s,
                "outer": s.outer,
                "current": current,
                "owners": (a.scope, b.scope),
                "len": len(s),
                "tensors": (a, b),
            }
            events.append(("exit", name))

    async def main() -> None:
        await asyncio.gather(task("a"), task("b"))

    asyncio.run(main())
    # the two scopes really were open at the same time
    assert events.index(("enter", "b")) < events.index(("exit", "a"))
    assert results["a"]["scope"] is not results["b"]["scope"]
    for r in results.values():
        assert r["outer"] is None
        assert r["current"] is r["scope"]
        assert r["owners"] == (r["scope"], r["scope"])
        assert r["len"] == 2
        assert all(t.is_disposed for t in r["tensors"])
    assert ts.current_scope() is None


def test_asyncio_task_inherits_the_enclosing_scope() -> None:
    """A task started inside a scope sees it as current; its own scope nests inside it."""
    seen: dict[str, Any] = {}

    async def task() -> None:
        seen["current"] = ts.current_scope()
        seen["made"] = torch.randn(2)
        with ts.scope() as inner:
            await asyncio.sleep(0)
            seen["inner_outer"] = inner.outer
            seen["inner_made"] = torch.randn(2)

    with ts.scope() as outer:
        asyncio.run(task())
        assert seen["current"] is outer
        assert seen["made"].scope is outer
        assert seen["inner_outer"] is outer
        assert seen["inner_made"].is_disposed
        assert ts.current_scope() is outer
    assert seen["made"].is_disposed


# --------------------------------------------------------------------------------------------
# The decorator form
# --------------------------------------------------------------------------------------------


def test_decorator_opens_a_new_scope_per_call() -> None:
    """``@ts.scope()`` gives every call its own scope, closed when the call returns."""
    seen: list[Any] = []

    @ts.scope()
    def step() -> None:
        seen.append(ts.current_scope())

    step()
    step()
    assert len(seen) == 2
    assert seen[0] is not None and seen[1] is not None
    assert seen[0] is not seen[1]
    assert isinstance(seen[0], ts.DisposeScope)
    assert seen[0].is_closed and seen[1].is_closed
    assert ts.current_scope() is None


def test_decorator_scope_has_the_given_name_and_nests() -> None:
    """A named decorator scope nests inside the caller's scope."""

    @ts.scope(name="fwd")
    def inspect_scope() -> tuple[Any, Any]:
        current = ts.current_scope()
        return current.name, current.outer

    assert inspect_scope() == ("fwd", None)
    with ts.scope() as outer:
        name, parent = inspect_scope()
        assert name == "fwd"
        assert parent is outer


def test_decorator_moves_returned_tensor_to_outer_scope() -> None:
    """The returned ref moves to the caller's scope; the call's temporaries are disposed."""
    temporaries: list[torch.Tensor] = []

    @ts.scope()
    def f(x: torch.Tensor) -> torch.Tensor:
        t = x * 2
        temporaries.append(t)
        return t + 1

    with ts.scope() as outer:
        x = torch.ones(3)
        y = f(x)
        assert y.scope is outer
        assert not y.is_disposed
        assert y.tolist() == [3.0, 3.0, 3.0]
        assert temporaries[0].is_disposed
        assert not x.is_disposed
    assert y.is_disposed


def test_decorator_without_outer_scope_returns_unowned_ref() -> None:
    """With no scope around the call, the result is an unowned ref that survives."""

    @ts.scope()
    def make() -> torch.Tensor:
        return torch.arange(3.0) * 2

    y = make()
    assert isinstance(y, ts.TensorRef)
    assert y.scope is None
    assert not y.is_disposed
    assert y.tolist() == [0.0, 2.0, 4.0]


def test_decorator_returning_a_tuple() -> None:
    """Owned refs inside a returned tuple all survive."""
    temporaries: list[torch.Tensor] = []

    @ts.scope()
    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        temporaries.append(torch.zeros(2))
        return torch.ones(2), torch.full((2,), 2.0)

    with ts.scope() as outer:
        a, b = pair()
        assert a.scope is outer and b.scope is outer
        assert a.tolist() == [1.0, 1.0] and b.tolist() == [2.0, 2.0]
        assert temporaries[0].is_disposed


def test_decorator_returning_a_list() -> None:
    """Owned refs inside a returned list all survive."""

    @ts.scope()
    def rows() -> list[torch.Tensor]:
        m = torch.arange(6.0).view(2, 3)
        return [m[0] * 1, m[1] * 1]

    result = rows()
    assert isinstance(result, list)
    assert [r.tolist() for r in result] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert all(r.scope is None and not r.is_disposed for r in result)


def test_decorator_returning_a_dict() -> None:
    """Owned refs that are values of a returned dict all survive."""

    @ts.scope()
    def named() -> dict[str, torch.Tensor]:
        x = torch.arange(4.0)
        return {"sum": x.sum(), "max": x.max()}

    with ts.scope() as outer:
        result = named()
        assert result["sum"].item() == 6.0
        assert result["max"].item() == 3.0
        assert result["sum"].scope is outer and result["max"].scope is outer


def test_decorator_returned_view_of_a_temporary_survives() -> None:
    """A returned view survives although its base (a temporary of the call) was disposed."""

    @ts.scope()
    def first_row() -> torch.Tensor:
        m = torch.arange(6.0).view(2, 3)
        return m[0]

    row = first_row()
    assert row.tolist() == [0.0, 1.0, 2.0]
    assert row.scope is None


def test_decorator_returning_an_argument_keeps_its_owner() -> None:
    """Only refs owned by the call's scope move: arguments come back untouched."""

    @ts.scope()
    def identity(t: torch.Tensor) -> torch.Tensor:
        return t

    unowned = ts.ref(torch.ones(2))
    plain = torch.ones(2)
    assert identity(unowned) is unowned and unowned.scope is None
    assert identity(plain) is plain and type(plain) is torch.Tensor
    with ts.scope() as s1:
        a = torch.ones(2)
        with ts.scope():
            assert identity(a) is a
            assert a.scope is s1
    assert a.is_disposed
    assert not unowned.is_disposed


def test_decorator_recursion() -> None:
    """Each recursive call has its own scope; results travel up one scope per return."""
    scopes: list[Any] = []

    @ts.scope()
    def power_of_two(x: torch.Tensor, n: int) -> torch.Tensor:
        scopes.append(ts.current_scope())
        if n == 0:
            return x * 1
        return power_of_two(x, n - 1) * 2

    with ts.scope() as outer:
        x = torch.ones(2)
        y = power_of_two(x, 4)
        assert y.tolist() == [16.0, 16.0]
        assert y.scope is outer
        assert len(outer) == 2  # x and the result
    assert len({id(s) for s in scopes}) == 5
    assert all(s.is_closed for s in scopes)


@ts.scope(name="batches")
def _scoped_batches(n: int) -> Iterator[torch.Tensor]:
    for i in range(n):
        temporary = torch.ones(3) * i  # the generator's own
        current = ts.current_scope()
        assert current is not None and current.name == "batches"
        yield temporary + 1
    return


def test_decorated_generator_body_runs_in_its_scope_and_the_consumer_does_not() -> None:
    """``@ts.scope()`` on a generator function: the scope is current while the body runs, not
    while it is suspended; yielded refs go to the consumer's scope (unowned without one)."""
    kept = []
    for batch in _scoped_batches(3):
        assert ts.current_scope() is None
        doubled = batch * 2
        assert type(doubled) is torch.Tensor  # the consumer has no scope: plain
        assert isinstance(batch, ts.TensorRef) and batch.scope is None
        kept.append(doubled)
    assert [k.tolist() for k in kept] == [[2.0] * 3, [4.0] * 3, [6.0] * 3]
    with ts.scope() as consumer:
        generator = _scoped_batches(2)
        first = next(generator)
        made = first * 3
        assert first.scope is consumer and made.scope is consumer
        rest = list(generator)
        assert [r.tolist() for r in rest] == [[2.0] * 3]
    assert first.is_disposed and made.is_disposed


def test_decorated_generator_closes_its_scope_when_closed_early_or_on_error() -> None:
    generator = _scoped_batches(5)
    item = next(generator)
    generator.close()
    assert ts.current_scope() is None and not item.is_disposed
    generator = _scoped_batches(5)
    next(generator)
    with pytest.raises(ValueError, match="boom"):
        generator.throw(ValueError("boom"))
    assert ts.current_scope() is None
    assert torch._C._len_torch_dispatch_stack() == 0


def test_decorator_refuses_async_generators() -> None:
    async def agen() -> AsyncIterator[int]:
        yield 1

    with pytest.raises(ts.ArgumentTypeError, match="coroutine"):
        ts.scope()(agen)


def test_decorator_keeps_function_metadata() -> None:
    """The decorated function keeps its name and docstring (functools.wraps)."""

    @ts.scope()
    def documented(x: int) -> int:
        """Doc string."""
        return x

    assert documented.__name__ == "documented"
    assert documented.__doc__ == "Doc string."
    assert documented(3) == 3


def test_decorator_exception_propagates_and_disposes() -> None:
    """An exception leaves the call unchanged and the call's tensors disposed."""
    made: list[torch.Tensor] = []
    error = KeyError("missing")

    @ts.scope()
    def fails() -> None:
        made.append(torch.ones(2))
        raise error

    with pytest.raises(KeyError) as info:
        fails()
    assert info.value is error
    assert made[0].is_disposed
    assert ts.current_scope() is None


# --------------------------------------------------------------------------------------------
# Weak references
# --------------------------------------------------------------------------------------------


def test_scope_holds_weak_references() -> None:
    """A scope does not keep its refs alive: a dropped ref is freed and leaves the scope."""
    with ts.scope() as s:
        t = torch.randn(1000)
        alive = weakref.ref(t)
        assert len(s) == 1
        del t
        gc.collect()
        assert alive() is None
        assert len(s) == 0
        assert s.tracked() == []


def test_temporaries_are_freed_at_once() -> None:
    """A temporary inside an expression is gone right away, without waiting for the scope."""
    with ts.scope() as s:
        x = torch.randn(8)
        y = (x * 2).sum()  # no gc.collect(): reference counting frees the product
        assert len(s) == 2
        tracked = s.tracked()
        assert any(t is x for t in tracked) and any(t is y for t in tracked)


# --------------------------------------------------------------------------------------------
# Exceptions
# --------------------------------------------------------------------------------------------


def test_exception_propagates_unchanged_and_scope_disposes() -> None:
    """The very exception object leaves the block; the scope is closed and its refs disposed."""
    error = ValueError("boom")
    with pytest.raises(ValueError) as info, ts.scope() as s:
        t = torch.randn(2)
        raise error
    assert info.value is error
    assert type(info.value) is ValueError
    assert s.is_closed
    assert t.is_disposed
    assert ts.current_scope() is None


def test_torch_error_inside_scope_keeps_its_type() -> None:
    """A torch error is not wrapped into a tensorscope error."""
    with pytest.raises(RuntimeError) as info, ts.scope():
        torch.randn(2, 3) @ torch.randn(2, 3)
    assert type(info.value) is RuntimeError
    assert not isinstance(info.value, ts.TensorScopeError)
    assert ts.current_scope() is None


def test_exception_in_nested_scopes_closes_all() -> None:
    """Every scope the exception leaves is closed, innermost first."""
    with pytest.raises(ZeroDivisionError), ts.scope() as s1:
        a = torch.randn(2)
        with ts.scope() as s2:
            b = torch.randn(2)
            _ = 1 / 0
    assert s1.is_closed and s2.is_closed
    assert a.is_disposed and b.is_disposed
    assert ts.current_scope() is None


def test_exception_after_explicit_close_still_propagates() -> None:
    """``__exit__`` of an already-closed scope is a no-op and never swallows the exception."""
    with pytest.raises(LookupError), ts.scope() as s:
        s.close()
        raise LookupError("after close")
    assert ts.current_scope() is None


def test_keyboard_interrupt_propagates() -> None:
    """BaseExceptions pass through too, with the scope closed."""
    with pytest.raises(KeyboardInterrupt), ts.scope() as s:
        t = torch.randn(2)
        raise KeyboardInterrupt
    assert s.is_closed and t.is_disposed


# --------------------------------------------------------------------------------------------
# Using a disposed ref
# --------------------------------------------------------------------------------------------


def test_disposed_error_names_shape_dtype_scope_and_site() -> None:
    """The message names shape, dtype, the disposing scope and the creation site."""
    with ts.scope(name="step"):
        x, line = torch.randn(4, 4), here()
    with pytest.raises(ts.DisposedTensorError) as info:
        _ = x + 1
    error = info.value
    assert isinstance(error, ts.ScopeError)
    assert isinstance(error, ts.TensorScopeError)
    assert isinstance(error, RuntimeError)
    message = str(error)
    assert message.startswith("tensorscope.scope:")
    assert "(4, 4)" in message
    assert "float32" in message
    assert "'step'" in message
    assert f"{FILE}:{line}" in message


def test_disposed_error_for_a_view_and_another_dtype() -> None:
    """A view reports its own shape, dtype and creation line."""
    with ts.scope(name="outer"):
        base = torch.zeros(6, dtype=torch.int64)
        view, line = base.view(2, 3), here()
    with pytest.raises(ts.DisposedTensorError) as info:
        view.sum()
    message = str(info.value)
    assert "(2, 3)" in message
    assert "int64" in message
    assert "'outer'" in message
    assert f"{FILE}:{line}" in message


def test_disposed_by_hand_error_names_site() -> None:
    """A ref disposed by ``dispose()`` (no scope involved) still says what and where."""
    u, line = ts.ref(torch.ones(3, 2, dtype=torch.float64)), here()
    u.dispose()
    with pytest.raises(ts.DisposedTensorError) as info:
        u.tolist()
    message = str(info.value)
    assert "(3, 2)" in message
    assert "float64" in message
    assert f"{FILE}:{line}" in message


def _disposed_4x4() -> torch.Tensor:
    with ts.scope(name="gone"):
        t = torch.randn(4, 4)
    return t


USES: dict[str, Callable[[torch.Tensor], Any]] = {
    "add": lambda t: t + 1,
    "radd": lambda t: 1 + t,
    "torch.add": lambda t: torch.add(t, t),
    "matmul": lambda t: t @ t,
    "method": lambda t: t.sum(),
    "clone": lambda t: t.clone(),
    "to float64": lambda t: t.to(torch.float64),
    "view": lambda t: t.view(16),
    "index": lambda t: t[0],
    "slice": lambda t: t[1:3],
    "setitem": lambda t: t.__setitem__(0, 1.0),
    "in-place add_": lambda t: t.add_(1),
    "iadd": lambda t: t.__iadd__(1),
    "copy_ into": lambda t: t.copy_(torch.zeros(4, 4)),
    "copy_ from": lambda t: torch.zeros(4, 4).copy_(t),
    "live + disposed": lambda t: torch.ones(4, 4) + t,
    "cat": lambda t: torch.cat([torch.zeros(4, 4), t]),
    "stack": lambda t: torch.stack([t, t]),
    "where": lambda t: torch.where(t > 0, t, torch.zeros(4, 4)),
    "comparison": lambda t: t == 0,
    "repr": repr,
    "str": str,
    "format": lambda t: f"{t}",
    "print": print,
    "numpy": lambda t: t.numpy(),
    "tolist": lambda t: t.tolist(),
    "np.asarray": np.asarray,
    "iterate": list,
    "sum builtin": lambda t: sum(t),
    "pickle": pickle.dumps,
    "torch.save": lambda t: torch.save(t, io.BytesIO()),
    "deepcopy": copy.deepcopy,
}


@pytest.mark.parametrize("use", list(USES.values()), ids=list(USES))
def test_using_a_disposed_ref_raises(use: Callable[[torch.Tensor], Any]) -> None:
    """Every use of a disposed ref raises DisposedTensorError: no crash, no silent result."""
    t = _disposed_4x4()
    with pytest.raises(ts.DisposedTensorError):
        use(t)
    # the two members that still work
    assert t.is_disposed
    t.dispose()


SCALAR_USES: dict[str, Callable[[torch.Tensor], Any]] = {
    "item": lambda t: t.item(),
    "float": float,
    "int": int,
    "bool": bool,
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy(),
    "format spec": lambda t: f"{t:.3f}",
}


@pytest.mark.parametrize("use", list(SCALAR_USES.values()), ids=list(SCALAR_USES))
def test_using_a_disposed_scalar_raises(use: Callable[[torch.Tensor], Any]) -> None:
    """Reading a disposed one-element ref raises DisposedTensorError."""
    with ts.scope():
        t = torch.full((), 1.5)
    with pytest.raises(ts.DisposedTensorError):
        use(t)


def test_disposed_ref_inside_a_live_scope_raises_too() -> None:
    """A ref disposed by hand while its scope is open cannot be used either."""
    with ts.scope() as s:
        t = torch.randn(3)
        t.dispose()
        with pytest.raises(ts.DisposedTensorError):
            t * 2
        assert not s.is_closed
        assert usable(torch.randn(3))


# --------------------------------------------------------------------------------------------
# A live ref behaves like a plain tensor
# --------------------------------------------------------------------------------------------


def test_live_ref_prints_like_a_plain_tensor(capsys: pytest.CaptureFixture[str]) -> None:
    """repr, str, format and print give exactly what a plain tensor gives."""
    plain = torch.arange(6.0).view(2, 3)
    with ts.scope():
        r = torch.arange(6.0).view(2, 3)
        assert isinstance(r, ts.TensorRef)
        assert repr(r) == repr(plain)
        assert str(r) == str(plain)
        assert f"{r}" == f"{plain}"
        assert f"{r[0, 1]:.2f}" == f"{plain[0, 1]:.2f}"
        print(r)
        print(plain)
    lines = capsys.readouterr().out.splitlines()
    half = len(lines) // 2
    assert lines[:half] == lines[half:]


def test_live_ref_converts_like_a_plain_tensor() -> None:
    """item, float, numpy and tolist give what a plain tensor gives."""
    plain = torch.arange(6.0).view(2, 3)
    with ts.scope():
        r = torch.arange(6.0).view(2, 3)
        assert r.tolist() == plain.tolist()
        array = r.numpy()
        assert isinstance(array, np.ndarray)
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, plain.numpy())
        assert r.sum().item() == 15.0
        assert float(r[1, 2]) == 5.0
        assert int(r[1, 1]) == 4
        assert bool(r[0, 1])
        assert r.shape == (2, 3)
        assert r.dtype == torch.float32
        assert len(r) == 2
        assert [row.tolist() for row in r] == plain.tolist()


def test_numpy_array_of_a_ref_keeps_its_data_after_the_scope() -> None:
    """An array taken with ``.numpy()`` inside a scope still holds its data afterwards."""
    arrays: list[np.ndarray] = []
    expected: list[list[float]] = []
    for i in range(3):
        with ts.scope():
            out = torch.arange(4096, dtype=torch.float32) * (i + 1)
            arrays.append(out.numpy())
            expected.append(out.tolist())
    churn = [torch.full((4096,), -1.0) for _ in range(16)]  # reuse any freed memory
    for array, values in zip(arrays, expected, strict=True):
        assert array.tolist() == values
    del churn


def test_torch_save_of_a_ref_saves_plain_data() -> None:
    """torch.save of refs (also in containers) loads back as plain tensors, even weights_only."""
    buffer = io.BytesIO()
    with ts.scope():
        r = torch.arange(6.0).view(2, 3)
        torch.save({"r": r, "rows": [r[0], r[1]]}, buffer)
        expected = r.tolist()
    unowned = ts.ref(torch.ones(2))
    unowned_buffer = io.BytesIO()
    torch.save(unowned, unowned_buffer)

    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded["r"]) is torch.Tensor
    assert loaded["r"].tolist() == expected
    assert [type(t) for t in loaded["rows"]] == [torch.Tensor, torch.Tensor]
    assert loaded["rows"][1].tolist() == expected[1]
    unowned_buffer.seek(0)
    again = torch.load(unowned_buffer, weights_only=True)
    assert type(again) is torch.Tensor
    assert again.tolist() == [1.0, 1.0]


def test_pickle_of_a_ref_gives_a_plain_tensor() -> None:
    """pickle round trips a ref's data as a plain tensor (what torch.save stores, too)."""
    unowned = ts.ref(torch.arange(3.0))
    restored = pickle.loads(pickle.dumps(unowned))
    assert type(restored) is torch.Tensor
    assert restored.tolist() == [0.0, 1.0, 2.0]
    with ts.scope():
        r = torch.arange(4.0)
        blob = pickle.dumps(r)
    restored = pickle.loads(blob)
    assert type(restored) is torch.Tensor
    assert restored.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_deepcopy_of_a_ref_is_an_independent_plain_tensor() -> None:
    """deepcopy makes a copy to keep: a plain, unowned tensor (as for a plain tensor, whose
    deepcopy torch requires to keep its class); it never copies the scope."""
    with ts.scope() as outer:
        a = torch.arange(4.0)
        with ts.scope():
            c = copy.deepcopy(a)
            assert c is not a
            assert torch.equal(c, a)
            assert c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
            assert type(c) is torch.Tensor
            assert a.scope is outer
            assert len(outer) == 1
        assert not a.is_disposed
        assert a.tolist() == [0.0, 1.0, 2.0, 3.0]

    unowned = ts.ref(torch.arange(3.0))
    d = copy.deepcopy(unowned)
    assert d is not unowned
    assert torch.equal(d, unowned)
    assert getattr(d, "scope", None) is None
    unowned.dispose()
    assert not getattr(d, "is_disposed", False)
    assert d.tolist() == [0.0, 1.0, 2.0]


def test_parameter_from_a_ref_is_a_parameter_never_disposed() -> None:
    """``nn.Parameter(ref)`` works inside and outside scopes and is never disposed by one."""
    unowned = ts.ref(torch.ones(3))
    p = nn.Parameter(unowned)
    assert isinstance(p, nn.Parameter)
    assert p.requires_grad
    with ts.scope():
        t = torch.ones(3)
        q = nn.Parameter(t)
        assert isinstance(q, nn.Parameter)
    assert not getattr(q, "is_disposed", False)
    assert q.tolist() == [1.0, 1.0, 1.0]
    assert q.requires_grad
    assert p.tolist() == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------------------------
# Views, indexing and in-place ops
# --------------------------------------------------------------------------------------------


def test_views_and_indexing_return_new_refs() -> None:
    """Every view is its own ref, owned by the current scope, sharing the base's storage."""
    with ts.scope() as s:
        x = torch.randn(4, 4)
        views = {
            "view": x.view(16),
            "t": x.t(),
            "transpose": x.transpose(0, 1),
            "index": x[0],
            "slice": x[1:3],
            "reshape": x.reshape(2, 8),
            "unsqueeze": x.unsqueeze(0),
            "detach": x.detach(),
            "narrow": x.narrow(0, 1, 2),
        }
        for name, v in views.items():
            assert isinstance(v, ts.TensorRef), name
            assert v is not x, name
            assert v.scope is s, name
            assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), name
        for pieces in (torch.split(x, 1), torch.chunk(x, 2), torch.unbind(x), x.split([1, 3])):
            assert all(isinstance(p, ts.TensorRef) and p.scope is s for p in pieces)
            assert len({id(p) for p in pieces}) == len(pieces)
    assert all(v.is_disposed for v in views.values())


def test_view_of_an_outer_ref_belongs_to_the_inner_scope() -> None:
    """A view made in an inner scope dies with it; the outer base keeps its (updated) data."""
    with ts.scope() as outer:
        x = torch.arange(8.0)
        with ts.scope() as inner:
            v = x[2:6]
            assert v.scope is inner
            v.mul_(10)  # writes through to x
        assert v.is_disposed
        assert not x.is_disposed
        assert x.scope is outer
        assert x.tolist() == [0.0, 1.0, 20.0, 30.0, 40.0, 50.0, 6.0, 7.0]


def test_view_of_a_plain_tensor_is_disposed_but_the_plain_tensor_is_intact() -> None:
    """Disposing a view never frees memory the scope did not allocate."""
    plain = torch.arange(6.0)
    with ts.scope():
        v = plain.view(2, 3)
        v.add_(1)
    assert v.is_disposed
    assert type(plain) is torch.Tensor
    assert plain.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_view_moved_out_survives_its_disposed_base() -> None:
    """A view keeps the base's storage alive: moved out, it outlives the base's scope."""
    with ts.scope():
        base = torch.arange(8.0)
        v = base[2:4].move_to_outer()
        pieces = [p.move_to_outer() for p in torch.split(base, 4)]
    assert base.is_disposed
    assert v.tolist() == [2.0, 3.0]
    assert [p.tolist() for p in pieces] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]


def test_disposing_base_or_view_keeps_the_other_usable() -> None:
    """``dispose()`` of a base leaves a live view usable, and the other way round."""
    with ts.scope():
        x = torch.arange(4.0)
        v = x[1:3]
        x.dispose()
        assert x.is_disposed
        assert v.tolist() == [1.0, 2.0]

        y = torch.arange(4.0)
        w = y[1:3]
        w.dispose()
        assert y.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_in_place_ops_return_the_same_object_and_keep_the_owner() -> None:
    """In-place ops (and ``out=``) return the very object, which keeps its owner."""
    with ts.scope() as outer:
        x = torch.zeros(3)
        with ts.scope() as inner:
            y = torch.ones(3)
            assert x.add_(y) is x
            same = x
            x += 1
            assert x is same
            assert torch.mul(y, 2, out=x) is x
            x[0] = 7.0
            assert x.scope is outer
            assert len(inner) == 1  # only y
        assert not x.is_disposed
        assert x.tolist() == [7.0, 2.0, 2.0]


def test_in_place_op_on_a_plain_tensor_keeps_it_plain() -> None:
    """An in-place op inside a scope does not turn a plain tensor into an owned ref."""
    plain = torch.zeros(3)
    with ts.scope() as s:
        assert plain.add_(1) is plain
        assert type(plain) is torch.Tensor
        assert plain not in s
    assert plain.tolist() == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------------------------
# Grad modes and autograd
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_scopes_work_under_grad_modes(grad_mode: Callable[[], Any]) -> None:
    """no_grad and inference_mode do not change what a scope records or disposes."""
    w = torch.randn(3, requires_grad=True)
    with grad_mode(), ts.scope() as s:
        y = w * 2
        z = y.view(3, 1)
        assert isinstance(y, ts.TensorRef) and y.scope is s
        assert z.scope is s
        assert not y.requires_grad
    assert y.is_disposed and z.is_disposed
    with ts.scope() as s2:
        with grad_mode():
            u = w + 1
        assert u.scope is s2
    assert u.is_disposed


def test_backward_inside_a_scope_matches_plain_autograd() -> None:
    """Backward inside a scope gives bit-identical gradients, which outlive the scope."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    (x @ w).relu().sum().backward()
    expected = w.grad.clone()
    w.grad = None
    with ts.scope():
        loss = (x @ w).relu().sum()
        loss.backward()
    assert loss.is_disposed
    assert not getattr(w.grad, "is_disposed", False)
    assert torch.equal(w.grad, expected)


# --------------------------------------------------------------------------------------------
# Memory release at scope exit
# --------------------------------------------------------------------------------------------


def test_scope_exit_releases_memory_even_if_python_keeps_a_reference() -> None:
    """The 256 MiB of a ref kept in an outer list go back to the OS when the scope closes."""
    process = psutil.Process()
    nbytes = 256 * 2**20
    keep: list[torch.Tensor] = []
    gc.collect()
    before = process.memory_info().rss
    with ts.scope():
        big = torch.ones(nbytes // 4)  # float32; ones() touches every page
        keep.append(big)
        during = process.memory_info().rss
    after = process.memory_info().rss
    assert during - before > 0.75 * nbytes, "the tensor was never resident; test is void"
    assert during - after > 0.75 * nbytes
    assert keep[0].is_disposed
    assert big.is_disposed


# --------------------------------------------------------------------------------------------
# Leak report
# --------------------------------------------------------------------------------------------


def test_leak_report_names_tensors_referenced_from_outside() -> None:
    """``report_leaks=True``: an owned ref kept in an outer list is warned about and listed."""
    keep: list[torch.Tensor] = []
    with pytest.warns(ts.LeakWarning) as record, ts.scope(report_leaks=True) as s:
        leaked, line = torch.zeros(3, 5), here()
        keep.append(leaked)
        local_only = torch.ones(2)
    assert len(s.leaks) == 1
    leak = s.leaks[0]
    assert tuple(leak.shape) == (3, 5)
    assert "float32" in str(leak.dtype)
    assert isinstance(leak.site, str)
    assert leak.site.endswith(f"{FILE}:{line}")
    text = "\n".join(str(w.message) for w in record if issubclass(w.category, ts.LeakWarning))
    assert "3, 5" in text
    assert "float32" in text
    assert f"{FILE}:{line}" in text
    # reported, and disposed all the same
    assert keep[0].is_disposed
    assert local_only.is_disposed


def test_leak_report_lists_every_leak() -> None:
    """Refs held by a dict and by an object attribute are both reported."""

    class Holder:
        pass

    holder = Holder()
    cache: dict[str, torch.Tensor] = {}
    with pytest.warns(ts.LeakWarning), ts.scope(report_leaks=True) as s:
        x, line_x = torch.zeros(2, dtype=torch.int64), here()
        y, line_y = torch.zeros(4, 1), here()
        cache["x"] = x
        holder.y = y  # type: ignore[attr-defined]
    sites = sorted(leak.site for leak in s.leaks)
    assert len(sites) == 2
    assert any(site.endswith(f"{FILE}:{line_x}") for site in sites)
    assert any(site.endswith(f"{FILE}:{line_y}") for site in sites)
    shapes = sorted(tuple(leak.shape) for leak in s.leaks)
    assert shapes == [(2,), (4, 1)]


def test_leak_warning_turned_into_an_error_still_closes_the_scope() -> None:
    """With LeakWarning as an error (this project's pytest default) the scope still closes."""
    keep: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.LeakWarning)
        with pytest.raises(ts.LeakWarning), ts.scope(report_leaks=True) as s:
            keep.append(torch.zeros(3))
            other = torch.ones(3)
    assert s.is_closed
    assert keep[0].is_disposed
    assert other.is_disposed
    assert ts.current_scope() is None


def test_locals_of_the_scope_frame_are_not_leaks() -> None:
    """Refs only held by local variables of the scope's own frame are not reported."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.LeakWarning)
        with ts.scope(report_leaks=True) as s:
            a = torch.zeros(3)
            b = a * 2
            c = b[0]
    assert s.leaks == []
    assert a.is_disposed and b.is_disposed and c.is_disposed


def test_refs_moved_out_are_not_leaks() -> None:
    """Refs the scope no longer owns at close are not leaks, wherever they are kept."""
    keep: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.LeakWarning)
        with ts.scope(report_leaks=True) as s:
            keep.append(torch.zeros(3).move_to_outer())
            keep.append(torch.zeros(3).detach_from_scope())
            gone = torch.zeros(3)
            keep.append(gone)
            gone.dispose()
    assert s.leaks == []
    assert not keep[0].is_disposed and not keep[1].is_disposed


def test_no_leak_report_by_default() -> None:
    """Without ``report_leaks`` nothing is warned; the kept ref is still disposed."""
    keep: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ts.LeakWarning)
        with ts.scope():
            keep.append(torch.zeros(3))
    assert keep[0].is_disposed


# --------------------------------------------------------------------------------------------
# Tensors over foreign memory
# --------------------------------------------------------------------------------------------


def test_from_numpy_and_frombuffer_make_owned_refs(stats) -> None:
    """from_numpy and frombuffer refs are owned and disposed; the foreign memory is untouched."""
    array = np.arange(6, dtype=np.float32)
    raw = bytearray(np.arange(4, dtype=np.float32).tobytes())
    with ts.scope() as s:
        a = torch.from_numpy(array)
        b = torch.frombuffer(raw, dtype=torch.float32)
        stats(created_in_scope=2)
        for t in (a, b):
            assert isinstance(t, ts.TensorRef)
            assert t.scope is s
        a.mul_(2)  # shares memory with the array
        assert array.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        assert b.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert a.is_disposed and b.is_disposed
    with pytest.raises(ts.DisposedTensorError):
        a + 1
    with pytest.raises(ts.DisposedTensorError):
        b.sum()
    # numpy and the bytearray still own valid memory
    assert array.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    array += 1
    assert array.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
    assert np.frombuffer(raw, dtype=np.float32).tolist() == [0.0, 1.0, 2.0, 3.0]
    raw[:4] = bytes(4)
    assert np.frombuffer(raw, dtype=np.float32)[0] == 0.0
