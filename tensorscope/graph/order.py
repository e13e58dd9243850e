"""A guess of next uses before any iteration is recorded: the order ``ts.manage()`` met the
weights.

Until the recorder predicts (the first iteration, or one that diverged from its predecessor),
Flow knows no next use and would read each weight only when an op needs it, one synchronous
read at a time. A model's parameters are registered in module order, and a forward mostly uses
them in that order (embedding, then layer after layer, then the head). So the weights after the
last one used are the guess for what comes next: Flow may read them ahead, and keeps them
rather than weights already used.

Parameters only: buffers are used out of module order (BERT's position ids come first, though
registered after every parameter). The guess only moves forward within an iteration (a backward
pass uses the weights in reverse: it then predicts nothing rather than something wrong), and
weights smaller than ``min_bytes`` take no part (a norm's weight is read in microseconds, and
modules register theirs after the projections they follow).

Pure Python: keys are opaque hashables.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

__all__ = ["ModuleOrder"]

MIN_GUESS_BYTES = 1 << 20


class ModuleOrder:
    """Registered keys in order, and a cursor at the furthest one used in this iteration.

    Example:
        >>> order = ModuleOrder(min_bytes=10)
        >>> for key, nbytes in [("embed", 100), ("norm", 4), ("q", 50), ("k", 50), ("head", 100)]:
        ...     order.add(key, nbytes)
        >>> order.advance(["embed"]); order.upcoming(2)
        ['q', 'k']
        >>> order.distance("k"), order.distance("embed"), order.distance("norm")
        (2, None, None)
        >>> order.advance(["head"]); order.advance(["q"]); order.upcoming(2)  # only forward
        []
    """

    def __init__(self, min_bytes: int = MIN_GUESS_BYTES) -> None:
        self.min_bytes = min_bytes
        self._keys: list[Hashable] = []
        self._index: dict[Hashable, int] = {}
        self.cursor = -1  # index of the furthest key used in this iteration

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable, nbytes: int) -> None:
        """Register ``key`` after those registered before it (once; small ones are left out)."""
        if nbytes >= self.min_bytes and key not in self._index:
            self._index[key] = len(self._keys)
            self._keys.append(key)

    def advance(self, keys: Iterable[Hashable]) -> None:
        """An op used ``keys``: the cursor moves to the furthest of them, never back."""
        index = self._index
        for key in keys:
            position = index.get(key)
            if position is not None and position > self.cursor:
                self.cursor = position

    def restart(self) -> None:
        """A new iteration begins at the first key."""
        self.cursor = -1

    def upcoming(self, limit: int) -> list[Hashable]:
        """The keys after the cursor, nearest first, at most ``limit``."""
        start = self.cursor + 1
        return self._keys[start : start + limit]

    def distance(self, key: Hashable) -> int | None:
        """How many registered keys ahead of the cursor ``key`` is (1: the next one); None for
        a key behind it (used already) or not registered."""
        position = self._index.get(key)
        if position is None or position <= self.cursor:
            return None
        return position - self.cursor

    def clear(self) -> None:
        self._keys.clear()
        self._index.clear()
        self.cursor = -1
