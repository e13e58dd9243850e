"""Pure modules (DESIGN.md): the algorithms take plain data and never import torch.

Importing any ``tensorscope.*`` module runs the package's ``__init__`` (the public API, which
needs torch), so this checks the modules' own module-level imports, followed transitively
through tensorscope's modules: none of them may reach ``torch``. Imports inside functions are
lazy (``Checkpointable``) and allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_independent  # pure modules, imported without torch

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "tensorscope"
PURE = [
    "tensorscope.errors",
    "tensorscope._units",
    "tensorscope._layout",
    "tensorscope.checkpoint",
    "tensorscope.checkpoint.chain",
    "tensorscope.checkpoint.find",
    "tensorscope.checkpoint.simulate",
    "tensorscope.checkpoint.solver",
    "tensorscope.policies",
    "tensorscope.policies.base",
    "tensorscope.policies.genoa",
    "tensorscope.policies.flow",
    "tensorscope.graph",
    "tensorscope.graph.analysis",
    "tensorscope.graph.order",
    "tensorscope.graph.record",
    "tensorscope.residency.tally",
    "tensorscope.plan.data",
    "tensorscope.plan.analysis",
    "tensorscope.plan.model",
    "tensorscope.plan.whatif",
    "tensorscope.plan.summary",
    "tensorscope.plan.snapshot",
    "tensorscope.fit.account",
    "tensorscope.fit.agree",
    "tensorscope.fit.decide",
    "tensorscope.fit.report",
    "tensorscope.fit.offload_rules",
    "tensorscope.fit.headform",
    "tensorscope.fit.phase",
]


def _path(module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    package = PACKAGE_ROOT / relative / "__init__.py"
    return package if package.exists() else PACKAGE_ROOT / relative.with_suffix(".py")


def _module_level_imports(module: str) -> set[str]:
    tree = ast.parse(_path(module).read_text())
    found: set[str] = set()
    for node in tree.body:  # module level only: lazy imports in functions are fine
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize("module", PURE)
def test_pure_module_never_imports_torch(module: str) -> None:
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for imported in _module_level_imports(current):
            top = imported.split(".")[0]
            assert top not in ("torch", "numpy"), f"{current} imports {imported}"
            if top == "tensorscope" and imported != "tensorscope":
                todo.append(imported)
