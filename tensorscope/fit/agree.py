"""What ranks agree on before a distributed fit decides (pure: plain data, no torch).

Every rank of an FSDP2 or DDP job runs ``ts.fit`` on its own measurements: its chain's block
times, its recorded step, its disk's bandwidth. Decided apart, two ranks could choose different
schedules -- and under FSDP2 recomputing a block gathers its parameters again, a collective the
other rank would never join. So the inputs are agreed first (NOTE [one decision across ranks])
and the pure decision (decide.py) then gives the same answer everywhere.

# NOTE [one decision across ranks]
# At each agreement point every rank gives what it measured and gets back, on every rank, the
# slowest and largest of them: each number the maximum over ranks (a time, a size: the
# decision then fits the rank that needs most, and is paced by the slowest), each flag true
# when it is true on any rank (a block uses random numbers), the budget the smallest (the
# rank with least memory decides). A choice one rank cannot make (its disk tier failed, it
# reads gradients for clipping) is taken off every rank: the ways of running the step outside
# the chain (account.StepBase) are kept only where every rank has them. A tensorscope error on
# any rank is raised on every rank, the same one (tensorscope/fit/ranks.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, TypeVar

from tensorscope.errors import InvalidArgumentError
from tensorscope.fit.account import StepBase

__all__ = ["budget_note", "common_bases", "reasons_of", "slowest"]

T = TypeVar("T")


def slowest(values: Sequence[T]) -> T:
    """The ranks' measurements as one (NOTE [one decision across ranks]): numbers the largest,
    flags true if any is, tuples and dataclasses field by field, ``None`` if any is.

    Raises:
        InvalidArgumentError: the ranks measured things of different shapes (a chain of
            another length, another block class).

    Example:
        >>> from tensorscope.fit.account import StepBase
        >>> a = StepBase(False, 100, 150, 120, 10, 10, 20, 0.5)
        >>> b = StepBase(False, 110, 140, 120, 10, 10, 20, 0.7)
        >>> merged = slowest([a, b])
        >>> merged.under_chain, merged.at_loss, merged.seconds
        (110, 150, 0.7)
        >>> slowest([(1, 2.0, True), (3, 1.0, False)])
        (3, 2.0, True)
    """
    if not values:
        raise ValueError("slowest() needs at least one value")
    first = values[0]
    if any(v is None for v in values):
        return None  # type: ignore[return-value]
    if isinstance(first, bool):
        return any(values)  # type: ignore[return-value]
    if isinstance(first, (int, float)):
        return max(values)  # type: ignore[type-var]
    if isinstance(first, str):
        if any(v != first for v in values):
            raise InvalidArgumentError(
                f"tensorscope.fit: the ranks measured different things ({sorted(set(values))}"  # type: ignore[type-var]
                f"): every rank must fit the same model with the same blocks"
            )
        return first
    if isinstance(first, tuple):
        if any(not isinstance(v, tuple) or len(v) != len(first) for v in values):
            lengths = sorted({len(v) for v in values})  # type: ignore[arg-type]
            raise InvalidArgumentError(
                f"tensorscope.fit: the ranks measured chains of different lengths ({lengths}): "
                f"every rank must fit the same model"
            )
        return tuple(slowest([v[i] for v in values]) for i in range(len(first)))  # type: ignore[index,return-value]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {
            f.name: slowest([getattr(v, f.name) for v in values]) for f in dataclasses.fields(first)
        }
        return dataclasses.replace(first, **fields)
    if any(v != first for v in values):
        raise InvalidArgumentError(
            f"tensorscope.fit: the ranks measured different things ({values!r})"
        )
    return first


def _key(base: StepBase) -> Hashable:
    """What tells one way of running the step from another (every choice a base carries)."""
    return (base.free_gradients, base.state_offloaded, bool(base.placed_bytes), base.chunked_loss)


def common_bases(per_rank: Sequence[Sequence[StepBase]]) -> list[StepBase]:
    """The ways of running the step that every rank has, in the first rank's order, each the
    slowest and largest of the ranks' (NOTE [one decision across ranks]).

    Example:
        >>> kept = StepBase(False, 100, 150, 120, 10, 10, 20, 0.5)
        >>> moved = dataclasses.replace(kept, under_chain=80, state_offloaded=True)
        >>> [b.state_offloaded for b in common_bases([[kept, moved], [kept]])]
        [False]
        >>> slower = dataclasses.replace(moved, seconds=0.9)
        >>> common_bases([[kept, moved], [kept, slower]])[1].seconds
        0.9
    """
    if not per_rank:
        return []
    keyed = [{_key(b): b for b in bases} for bases in per_rank]
    out = []
    for base in per_rank[0]:
        key = _key(base)
        if all(key in each for each in keyed):
            out.append(slowest([each[key] for each in keyed]))
    return out


def reasons_of(per_rank: Sequence[Sequence[str]]) -> list[str]:
    """Every rank's reasons to keep gradients, once each, in the order first given; a reason
    given on some ranks only says which.

    Example:
        >>> reasons_of([["clipping"], ["clipping", "accumulation"]])
        ['clipping', 'accumulation (on rank 1)']
    """
    order: list[str] = []
    ranks: dict[str, list[int]] = {}
    for rank, reasons in enumerate(per_rank):
        for reason in reasons:
            if reason not in ranks:
                order.append(reason)
                ranks[reason] = []
            ranks[reason].append(rank)
    everyone = len(per_rank)
    out = []
    for reason in order:
        on = ranks[reason]
        if len(on) == everyone:
            out.append(reason)
        else:
            which = ", ".join(str(r) for r in on)
            out.append(f"{reason} (on rank{'s' if len(on) > 1 else ''} {which})")
    return out


def budget_note(budgets: Sequence[int], format_bytes: Any) -> str:
    """What ``explain()`` says when the ranks were given different budgets (``""``: the same).

    Example:
        >>> budget_note([100, 100], str)
        ''
        >>> budget_note([100, 80, 90], lambda n: f"{n} B")  # doctest: +ELLIPSIS
        'the ranks were given different budgets (80 B to 100 B): ... the smallest, 80 B (rank 1)'

    """
    if len(set(budgets)) <= 1:
        return ""
    least = min(budgets)
    return (
        f"the ranks were given different budgets ({format_bytes(least)} to "
        f"{format_bytes(max(budgets))}): every rank decides under the smallest, "
        f"{format_bytes(least)} (rank {budgets.index(least)})"
    )
