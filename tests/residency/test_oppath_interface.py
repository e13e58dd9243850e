"""The op path talks to the manager through a narrow public interface (oppath.py's
``OpPathManager``; manager.py's NOTE [the op path's interface]), and pins are held only
through ``manager.pinned`` (pins.py)."""

from __future__ import annotations

import ast
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

import tensorscope as ts
from tensorscope.residency import manager as manager_module
from tensorscope.residency import oppath
from tensorscope.residency.oppath import OpPathManager
from tensorscope.residency.pins import Pins

pytestmark = pytest.mark.engine_independent  # reads source; pins plain objects

SOURCE = Path(oppath.__file__).read_text()


def _attribute_accesses() -> list[tuple[str, str, int]]:
    """(what it is read on, the attribute, line) for every attribute access in oppath.py."""
    return [
        (ast.unparse(node.value), node.attr, node.lineno)
        for node in ast.walk(ast.parse(SOURCE))
        if isinstance(node, ast.Attribute)
    ]


def test_the_op_path_reads_nothing_private_of_the_manager() -> None:
    manager_names = {"manager", "self.manager"}
    private = [
        f"line {line}: {on}.{attr}"
        for on, attr, line in _attribute_accesses()
        if on in manager_names and attr.startswith("_")
    ]
    assert not private, private
    used = {attr for on, attr, _ in _attribute_accesses() if on in manager_names}
    declared = set(OpPathManager.__annotations__) | {
        name for name in vars(OpPathManager) if not name.startswith("_")
    }
    assert used <= declared, f"declare these in OpPathManager: {sorted(used - declared)}"


def test_the_interface_is_the_managers_public_one() -> None:
    declared = set(OpPathManager.__annotations__) | {
        name for name in vars(OpPathManager) if not name.startswith("_")
    }
    assert len(declared) >= 20
    assert not [name for name in declared if not hasattr(ts.residency, name)]


def test_the_op_path_never_counts_pins() -> None:
    counted = [line for _, attr, line in _attribute_accesses() if attr == "pins"]
    assert not counted, f"pins counted by hand at lines {counted}: use manager.pinned()"
    package = Path(manager_module.__file__).parents[1]
    changed = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in package.rglob("*.py")
        if path.name != "pins.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.AugAssign, ast.Assign))
        and any(
            isinstance(t, ast.Attribute) and t.attr == "pins"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    # Placement.__init__ sets pins = 0; nothing else but pins.py changes them
    assert [c.partition(":")[0] for c in changed] == ["residency/placement.py"], changed


@dataclass
class _Placement:
    pins: int = 0


def _pins(placements: list[_Placement]) -> tuple[Pins, threading.Condition]:
    lock = threading.RLock()
    room = threading.Condition(lock)
    return Pins(placements, lock, room, 0.01), room


def test_pins_are_given_back_on_every_way_out() -> None:
    a, b = _Placement(), _Placement(pins=1)  # b: pinned by another op as well
    pins, _ = _pins([a, b])
    with pins:
        assert (a.pins, b.pins) == (1, 2)
    assert (a.pins, b.pins) == (0, 1)
    with pytest.raises(KeyError), _pins([a, b])[0]:
        assert (a.pins, b.pins) == (1, 2)
        raise KeyError("the op failed")
    assert (a.pins, b.pins) == (0, 1)
    pins, _ = _pins([a])
    with pins:
        pins.release()  # early, before the block ends
        assert a.pins == 0
        pins.release()  # once only
    assert a.pins == 0


def test_waiting_for_room_lets_go_of_the_pins_meanwhile() -> None:
    a = _Placement()
    pins, room = _pins([a])
    seen: list[int] = []

    def other_thread() -> None:
        with room:  # the waiter let go of the lock and of its pins
            seen.append(a.pins)
            room.notify_all()

    with pins:
        with room:
            thread = threading.Thread(target=other_thread)
            thread.start()
            pins.wait_for_room()
            assert a.pins == 1  # pinned again
        thread.join()
    assert seen == [0] and a.pins == 0
