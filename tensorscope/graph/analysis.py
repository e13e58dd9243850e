"""Pure analysis of a recorded iteration: when is each tensor used next?

No torch here: a trace is a list of ops, each a tuple of hashable keys (the roles of the
tensors the op touched). Tested without tensors.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Hashable, Sequence

__all__ = ["NextUse", "next_use_table"]


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

    def upcoming(self, position: int, limit: int) -> list[Hashable]:
        """Distinct keys used after ``position``, in order of first use, at most ``limit``."""
        seen: dict[Hashable, None] = {}
        for keys in self.ops[position + 1 :]:
            for key in keys:
                if key not in seen:
                    seen[key] = None
                    if len(seen) >= limit:
                        return list(seen)
        return list(seen)
