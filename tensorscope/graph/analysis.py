"""Pure analysis of a recorded iteration: when is each tensor used next?

No torch here: a trace is a list of ops, each a tuple of hashable keys (the roles of the
tensors the op touched). Tested without tensors.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

__all__ = ["NextUse", "decision_points", "next_use_table"]

K = TypeVar("K", bound=Hashable)  # a tensor's key in a trace (a role)


def next_use_table(ops: Sequence[Sequence[Hashable]]) -> dict[Hashable, list[int]]:
    """For each key, the sorted op indices at which it is used.

    Example:
        >>> next_use_table([("a", "b"), ("b",), ("a",)])
        {'a': [0, 2], 'b': [0, 1]}
    """
    table: dict[Hashable, list[int]] = {}
    for index, keys in enumerate(ops):
        for key in keys:
            uses = table.setdefault(key, [])
            if not uses or uses[-1] != index:
                uses.append(index)
    return table


class NextUse:
    """Answers "at which op index after ``position`` is ``key`` used next?" for one trace.

    Example:
        >>> nu = NextUse([("w1",), ("w2",), ("w1",)])
        >>> nu.after("w1", 0), nu.after("w2", 1), nu.after("w3", 0)
        (2, None, None)
    """

    def __init__(self, ops: Sequence[Sequence[Hashable]]) -> None:
        self.ops = [tuple(keys) for keys in ops]
        self.table = next_use_table(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def after(self, key: Hashable, position: int) -> int | None:
        """The first index strictly after ``position`` where ``key`` is used, or None."""
        uses = self.table.get(key)
        if not uses:
            return None
        index = bisect_right(uses, position)
        return uses[index] if index < len(uses) else None

    def upcoming(self, position: int, limit: int, through: int = -1) -> list[Hashable]:
        """Distinct keys used after ``position``, in order of first use: at most ``limit``,
        or more where the ops up to index ``through`` use more.

        Example:
            >>> nu = NextUse([("a",), ("b",), ("c",), ("d",)])
            >>> nu.upcoming(0, 1), nu.upcoming(0, 1, through=2)
            (['b'], ['b', 'c'])
        """
        seen: dict[Hashable, None] = {}
        for index in range(position + 1, len(self.ops)):
            if index > through and len(seen) >= limit:
                break
            for key in self.ops[index]:
                if key not in seen:
                    seen[key] = None
                    if index > through and len(seen) >= limit:
                        return list(seen)
        return list(seen)


def decision_points(
    ops: Sequence[Sequence[K]], nbytes: Callable[[K], int], stride: int
) -> list[int]:
    """Op indices that cut an iteration into stretches of about ``stride`` bytes of tensors
    first used there: where a policy deciding coarsely decides (see residency/cadence.py).

    Index 0 is always one; a new stretch begins at the op whose first-used tensors bring the
    current one to ``stride`` bytes or more.

    Example (tensors of 4, 4, 4 and 8 bytes, first used by ops 0, 2, 3 and 4):
        >>> sizes = {"a": 4, "b": 4, "c": 4, "d": 8}
        >>> decision_points([("a",), ("a",), ("b",), ("c",), ("d", "a")], sizes.__getitem__, 8)
        [0, 3]
    """
    points = [0] if ops else []
    seen: set[K] = set()
    filled = 0
    for index, keys in enumerate(ops):
        for key in keys:
            if key not in seen:
                seen.add(key)
                filled += nbytes(key)
        if filled >= stride and index + 1 < len(ops):
            points.append(index + 1)
            filled = 0
    return points
