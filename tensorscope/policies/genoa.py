"""Genoa (torch.TensorRef's first strategy): promote operands right before each op, demote
operands and results right after. Least device memory, most traffic."""

from __future__ import annotations

from tensorscope.policies.base import Action, OpView, Snapshot, take_until

__all__ = ["Genoa"]


class Genoa:
    """Keep nothing on the device between ops.

    Example:
        >>> from tensorscope.policies.base import OpView
        >>> Genoa().after_op(OpView("mm", operands=(1, 2), results=(3,)))
        [Action(kind='demote', key=1), Action(kind='demote', key=2), Action(kind='demote', key=3)]
    """

    name = "genoa"
    wants_snapshot_after_op = False

    def evict(self, snapshot: Snapshot, needed_bytes: int) -> list[int]:
        # Everything idle goes, least recently used first.
        idle = sorted((e for e in snapshot.entries if not e.busy), key=lambda e: e.last_use)
        return take_until(idle, needed_bytes)

    def after_op(self, op: OpView) -> list[Action]:
        seen: dict[int, None] = dict.fromkeys((*op.operands, *op.results))
        return [Action("demote", key) for key in seen]

    def __repr__(self) -> str:
        return "Genoa()"
