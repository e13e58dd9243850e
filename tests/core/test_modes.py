"""Every torch mode of tensorscope derives from one base (tensorscope/_modes.py), which alone
says how our modes meet torch.compile; and what it says has the effect its NOTE claims."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import tensorscope
from tensorscope._modes import DispatchMode, Mode
from tensorscope.checkpoint.tracker import StorageTracker

pytestmark = pytest.mark.engine_independent  # our modes, used on plain tensors

PACKAGE = Path(tensorscope.__file__).parent
DYNAMO_ATTRIBUTES = {
    "_should_skip_dynamo",
    "ignore_compile_internals",
    "supports_higher_order_operators",
    "is_infra_mode",
}


def _subclasses(base: type) -> set[type]:
    found: set[type] = set()
    todo = [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_every_mode_of_the_package_derives_from_the_base() -> None:
    for info in pkgutil.walk_packages([str(PACKAGE)], "tensorscope."):
        if not info.name.endswith(("plot", "__main__")):  # plot needs matplotlib
            importlib.import_module(info.name)
    ours = {
        cls
        for cls in _subclasses(TorchDispatchMode) | _subclasses(TorchFunctionMode)
        if cls.__module__.startswith("tensorscope.")
    }
    names = {cls.__name__ for cls in ours}
    assert {"Interceptor", "PlanMode", "StorageTracker", "LossMode"} <= names
    assert all(issubclass(cls, Mode) for cls in ours), [c for c in ours if not issubclass(c, Mode)]


def test_only_the_base_sets_what_dynamo_reads() -> None:
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_modes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    names = [item.name]
                else:
                    targets = getattr(item, "targets", [getattr(item, "target", None)])
                    names = [t.id for t in targets if isinstance(t, ast.Name)]
                wrong += [f"{path.name}: {node.name}.{n}" for n in names if n in DYNAMO_ATTRIBUTES]
    assert not wrong, wrong


class _Counting(DispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _frames_compiled(mode: TorchDispatchMode) -> int:
    import torch._dynamo.testing

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")

    @torch.compile(backend=counter)
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).cos() + 1

    x = torch.randn(256)
    with mode:
        out = f(x)
    assert torch.allclose(out, (x.sin() * 2).cos() + 1)
    torch._dynamo.reset()
    return counter.frame_count


def test_a_mode_compiles_under_it_and_the_tracker_runs_eagerly() -> None:
    """Our modes ignore compile internals: torch.compile compiles with one pushed. The
    StorageTracker (``eager_under_compile``) must see every allocation: dynamo runs the code
    eagerly under it, and it counts what eager code allocates."""
    assert not _Counting.supports_higher_order_operators and not _Counting._should_skip_dynamo()
    assert _frames_compiled(_Counting()) == 1
    tracker = StorageTracker()
    assert _frames_compiled(tracker) == 0
    assert tracker.peak_nbytes >= 2 * 256 * 4  # two 1 KiB temporaries live at once
    tracker.close()
