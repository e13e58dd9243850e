"""Imports point down: the layer order of the package, written once, and checked.

Every ``tensorscope`` import a module makes at run time (at module level or inside a function;
``if TYPE_CHECKING:`` blocks excluded) must name a module of a lower layer, or of its own
package below it; and no import cycle may exist between modules. A package with an order of its
own (``INSIDE``) is checked the same way between its modules. A module docstring that names its
layer ("Layer 7: imports only layers 0-6") must name the one written here. CONTRIBUTING
(README) points here: to add a module, give it a layer in ``LAYERS`` (and in ``INSIDE`` for a
package listed there).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import tensorscope

pytestmark = pytest.mark.engine_independent  # reads source files

PACKAGE = Path(tensorscope.__file__).parent

# Lowest first. A package ("residency") is one unit here; inside it only cycles are checked.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "_fast", "_storage"),  # the exception hierarchy; the C++ engine; the storage door
    # pure Python: no torch plumbing; what the C++ engine and Python share (its layout)
    ("_units", "policies", "graph", "_layout"),
    ("_engine",),  # the C++ scope engine, when built
    # typed doors to torch internals; creation sites; our global optimizer-step hooks
    # what copies of a module leave out (hooks and attributes of ours); the op table; the
    # base of our torch modes; doors to FSDP2/DDP
    ("_torch", "_sites", "_step_hooks", "_copies", "_optable", "_modes", "_sharded"),
    ("_state", "_slot"),  # ref records and the owner contract; the residency slot
    ("_thread",),  # per-thread state
    ("_plain", "_reach"),  # plain-tensor protocols of refs; tensors reachable from a value
    ("ref",),  # TensorRef, disposal
    # torch.optim step hooks; torch entry points that keep state; torch.compile'd outputs
    ("_optimizer", "_keepers", "_compiled"),
    ("_adopt", "_leaks"),  # how results become refs (both engines); the leak report
    # the scope key's kernels: the Python engine, shared fallthroughs; aliases user code asks
    # for by name (aten.alias, aten.detach, torch.detach), which fall through the key
    ("_fallback", "_aliases"),
    ("_intercept",),  # the residency manager's dispatch mode; hooks installed once
    ("scope",),  # DisposeScope, statistics
    ("residency", "empty_init"),  # the residency manager package; meta-device construction
    ("loading",),  # ts.manage(checkpoint=...)
    ("manage",),  # ts.manage()
    ("checkpoint", "memory", "plan"),  # rotor; RSS sampling; the memory plan of a step
    # ts.fit: one plan of a training step under a byte budget; activation offload (offload*.py);
    # the LM head and loss in row chunks (chunkloss.py; headform.py, pure; causal_lm.py)
    ("fit",),
    # `tensorscope demo`; callbacks for other libraries (HF Trainer); `tensorscope check`
    ("demo", "integrations", "check"),
    ("cli", "__init__"),  # the command line and the public face
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}

# The order inside a package, lowest first ("__init__": the package's face, on top).
INSIDE: dict[str, list[tuple[str, ...]]] = {
    "residency": [
        # what differs per device: allocations, copies, events, pinned staging (API §12)
        ("backends",),
        # settings, estimates, mapped files, tier names, the disk's pace, the module watchers
        ("config", "estimate", "integrity", "mapping", "pace", "report", "split", "tempdirs"),
        ("tiers", "watch", "checkpoint_files", "signals"),
        # the disk tier: a tier never calls up into the op path (disk.py's NOTE [arena
        # watchers]: native.py subscribes to arena moves)
        ("disk",),
        ("native",),  # the C++ op path's mirror of the ledger
        ("placement",),
        # where bytes are counted; byte moves; prefetch threads; where ops are counted; pins
        ("ledger", "movers", "prefetch", "tally", "pins"),
        ("cadence", "modules", "room"),  # when the policy decides; ts.manage's modules; room
        ("oppath",),  # what runs around every op on managed tensors
        ("managed", "manager"),  # managed parameters' classes; the manager
        ("__init__",),
    ],
}
INSIDE_RANK = {
    package: {module: rank for rank, modules in enumerate(order) for module in modules}
    for package, order in INSIDE.items()
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts)


def _unit(module: str) -> str:
    return module.split(".")[0]


def _runtime_imports(path: Path) -> set[str]:
    """``tensorscope`` names imported at run time (TYPE_CHECKING blocks skipped): a module, or
    ``module:name`` for ``from module import name`` (a submodule or an attribute)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tensorscope"):
                    found.add(alias.name.removeprefix("tensorscope").lstrip("."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "tensorscope":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("tensorscope."):
                base = node.module.removeprefix("tensorscope.")
                found.update(f"{base}:{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _runtime_imports(path):
            base, _, attribute = imported.partition(":")
            submodule = f"{base}.{attribute}"
            is_module = submodule in modules or f"{submodule}.__init__" in modules
            targets.add(submodule if attribute and is_module else base)
        graph[name.removesuffix(".__init__")] = targets
    return graph


def _inside(module: str) -> tuple[str, str] | None:
    """(package, module inside it) for a module of a package with an order of its own."""
    package, _, inner = module.partition(".")
    if package not in INSIDE:
        return None
    return package, inner.split(".")[0] or "__init__"


def test_every_module_has_a_layer() -> None:
    graph = _graph()
    units = {_unit(name) for name in graph}
    missing = sorted(unit for unit in units if unit not in RANK and unit)
    assert not missing, f"give these a layer in LAYERS: {missing}"
    inside = {found for name in graph if (found := _inside(name))}
    missing_inside = sorted(f"{p}.{m}" for p, m in inside if m not in INSIDE_RANK[p])
    assert not missing_inside, f"give these a layer in INSIDE: {missing_inside}"


def test_imports_inside_a_package_point_down() -> None:
    wrong = []
    for module, targets in _graph().items():
        here = _inside(module)
        for target in targets:
            there = _inside(target)
            if here is None or there is None or here[0] != there[0] or here == there:
                continue
            order = INSIDE_RANK[here[0]]
            if order[there[1]] >= order[here[1]]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports inside a package that do not point down:\n" + "\n".join(
        sorted(wrong)
    )


DOCSTRING_LAYER = re.compile(r"\bLayer (\d+)\b(?:[^.\n]*?\blayers 0-(\d+)\b)?")


def test_docstrings_name_the_layer_written_here() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        name = _module_name(path).removesuffix(".__init__")
        rank = RANK[_unit(name) if name != "__init__" else "__init__"]
        for found in DOCSTRING_LAYER.finditer(docstring):
            said, below = int(found.group(1)), found.group(2)
            if said != rank or (below is not None and int(below) != rank - 1):
                wrong.append(f"{name}: says {found.group(0)!r}, LAYERS gives layer {rank}")
    assert not wrong, "module docstrings that disagree with LAYERS:\n" + "\n".join(wrong)


def test_the_docstring_check_reads_what_modules_write() -> None:
    found = DOCSTRING_LAYER.search("Layer 9: imports only layers 0-8.")
    assert found is not None and found.groups() == ("9", "8")
    found = DOCSTRING_LAYER.search("Layer 13 (residency): imports only torch.")
    assert found is not None and found.groups() == ("13", None)
    stated = [
        path
        for path in PACKAGE.rglob("*.py")
        if DOCSTRING_LAYER.search(ast.get_docstring(ast.parse(path.read_text())) or "")
    ]
    assert len(stated) >= 10  # the check has modules to check


def test_imports_point_down() -> None:
    wrong = []
    for module, targets in _graph().items():
        unit = _unit(module) if module else "__init__"
        for target in targets:
            target_unit = _unit(target)
            if target_unit == unit:
                continue  # inside one package: see the cycle test
            if RANK[target_unit] >= RANK[unit]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that do not point down:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[str] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target in graph and state.get(target) is None:
                walk(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if state.get(node) is None:
            walk(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
