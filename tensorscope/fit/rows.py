"""Row blocks of a large tensor of optimizer state (pure: plain data, no torch).

The state store writes such a tensor out in blocks of whole rows, and a parameter whose state
is split is updated one block at a time (fit/statestore.py, NOTE [updates in row blocks]), so
that its update holds one block of each state tensor, not the whole of it. The account uses the
same rule to predict that (fit/account.py).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ROW_BLOCK_BYTES", "block_bytes", "row_ranges"]

ROW_BLOCK_BYTES = 4 << 20


def row_ranges(
    shape: Sequence[int], nbytes: int, block: int = ROW_BLOCK_BYTES
) -> list[tuple[int, int]]:
    """The ``(start, stop)`` rows of each block of a tensor of ``shape`` and ``nbytes``; one
    range covering it when it is not split (``block`` <= 0, at most ``block`` bytes, fewer than
    two rows).

    Example:
        >>> row_ranges((10, 4), 160, block=48)
        [(0, 3), (3, 6), (6, 9), (9, 10)]
        >>> row_ranges((10, 4), 160, block=0)
        [(0, 10)]
    """
    rows = shape[0] if shape else 1
    if block <= 0 or nbytes <= block or rows < 2:
        return [(0, rows)]
    per = max(1, block // (nbytes // rows))
    return [(start, min(start + per, rows)) for start in range(0, rows, per)]


def block_bytes(shape: Sequence[int], nbytes: int, block: int = ROW_BLOCK_BYTES) -> int:
    """Bytes of the largest block of such a tensor (``nbytes`` when it is not split).

    Example:
        >>> block_bytes((10, 4), 160, block=48), block_bytes((10, 4), 160, block=0)
        (48, 160)
    """
    ranges = row_ranges(shape, nbytes, block)
    if len(ranges) == 1:
        return nbytes
    start, stop = ranges[0]
    return (stop - start) * (nbytes // shape[0])
