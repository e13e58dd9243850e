"""What a recorded step is, as plain data: the recorder fills a :class:`StepRecord`, the
analysis turns it into a :class:`~tensorscope.plan.model.MemoryPlan`.

Pure Python, no torch (layer 1 in spirit; the package as a whole sits above the residency
manager): everything here is numbers, strings and tuples, so the analysis, ``what_if`` and the
exports are tested without tensors, and a plan can be pickled and kept.

Op indices: op ``i`` is the ``i``-th op the recorder saw; "at op ``i``" means right after op
``i`` ran, before op ``i + 1`` began. A storage made by op ``c`` and freed before op ``f``
began is alive at ops ``c .. f - 1``; one that existed before the step has ``created == -1``
and is alive from op 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "CATEGORIES",
    "PHASES",
    "ROLES",
    "SHARDED_CATEGORIES",
    "CallRecord",
    "OpRecord",
    "StepRecord",
    "StorageRecord",
    "categories_of",
]

#: The categories of ``MemoryPlan.at_peak``, in the order they are stacked and printed.
CATEGORIES: tuple[str, ...] = (
    "parameter",
    "sharded_parameter",
    "unsharded_parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "temporary",
    "reduce_scatter",
    "other",
)

#: FSDP2's own categories (docs/api.md §11): a plan shows them only where it has such storages.
SHARDED_CATEGORIES: tuple[str, ...] = ("sharded_parameter", "unsharded_parameter", "reduce_scatter")


def categories_of(present: Iterable[str]) -> tuple[str, ...]:
    """The categories a plan shows, given those of its storages: all of :data:`CATEGORIES`
    but FSDP2's own where no storage has them.

    Example:
        >>> categories_of(["parameter"])[:3], len(categories_of(["reduce_scatter"]))
        (('parameter', 'gradient', 'optimizer_state'), 9)
    """
    found = set(present)
    if not found.intersection(SHARDED_CATEGORIES):
        return tuple(c for c in CATEGORIES if c not in SHARDED_CATEGORIES)
    return CATEGORIES


#: What was running when an op ran: a forward (anything outside the other two), autograd's
#: backward, or an optimizer's ``step``/``zero_grad``.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")

#: What the recorder learned a storage is, besides what ops did with it ("" for nothing).
#: FSDP2 adds three (docs/api.md §11; NOTE [what FSDP2 holds] in tensorscope/_sharded.py).
ROLES: tuple[str, ...] = (
    "",
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "sharded_parameter",
    "unsharded_parameter",
    "reduce_scatter",
)


@dataclass
class StorageRecord:
    """One storage (a tensor and all its views) seen during the step.

    Attributes:
        nbytes: the storage's size in bytes (the largest seen, should it grow).
        created: op that made it; -1 when it existed before the step.
        freed: op before which it was freed; None when it outlived the step.
        last_use: last op that read or wrote it (-1: no op touched it).
        last_forward_use: last op outside autograd's backward that touched it (-1: none).
        first_backward_use: first op of a backward that touched it (-1: none).
        last_backward_use: last op of a backward that touched it (-1: none).
        site: index into ``StepRecord.sites``: where it was made (or first used).
        shape, dtype, device: of the first tensor seen on it.
        role: see :data:`ROLES`.
        name: the parameter's (or buffer's) name, ``owner``'s name for gradients and optimizer
            state; "" when unknown.
        owner: the storage index of the parameter it belongs to (its gradient, its optimizer
            state, a temporary of its update); -1 for none.
        saved: autograd saved it for backward (a saved-tensor hook saw it).
        saved_by: the module calls (indices into ``StepRecord.calls``) whose forward saved it.
        call: the module call running when it was made (-1: none).
    """

    nbytes: int
    created: int
    freed: int | None = None
    last_use: int = -1
    last_forward_use: int = -1
    first_backward_use: int = -1
    last_backward_use: int = -1
    site: int = 0
    shape: tuple[int, ...] = ()
    dtype: str = ""
    device: str = "cpu"
    role: str = ""
    name: str = ""
    owner: int = -1
    saved: bool = False
    saved_by: tuple[int, ...] = ()
    call: int = -1


@dataclass(frozen=True)
class OpRecord:
    """One op: its name (``"aten::addmm"``), when it began (seconds since the step began),
    where (an index into ``StepRecord.sites``), the innermost module call running (-1: none),
    its phase (:data:`PHASES`), and for an op of autograd's backward the forward op whose
    backward it runs (-1: unknown)."""

    name: str
    start_s: float
    site: int
    call: int
    phase: str
    forward_op: int = -1


@dataclass
class CallRecord:
    """One call of an ``nn.Module``'s forward: its path in the model (``"transformer.h.3"``),
    the ops it ran (``start`` to ``end``, end exclusive) and when (seconds), the call it ran
    inside (-1: none), the storages it was given and returned, and whether it ran during a
    backward (a recomputation by ``torch.utils.checkpoint``)."""

    path: str
    start: int
    end: int = -1
    start_s: float = 0.0
    end_s: float = 0.0
    parent: int = -1
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    recompute: bool = False


@dataclass
class StepRecord:
    """Everything the recorder saw in one step, as plain data.

    Attributes:
        ops, storages, calls: as above, in the order they happened.
        sites: ``"file.py:12 in forward"`` texts that ops and storages point into (index 0:
            ``""``, no user frame).
        optimizer_steps: ``(start, end)`` op ranges of each optimizer step (end exclusive).
        gradient_readers: names of the ops outside backward and optimizer steps that read a
            gradient (``clip_grad_norm_``'s norms, a grad scaler's unscale).
        seconds: the step's duration.
        tier_changes: ``(op, {storage: tier})`` for storages the residency manager manages,
            in op order: each entry gives the tiers that changed since the previous one, read
            when the step's bytes reached a new high (empty without ``ts.manage``).
        module_ids: ``id(module) -> path`` for the modules that ran (``what_if`` accepts
            modules for as long as they are alive).
    """

    ops: list[OpRecord] = field(default_factory=list)
    storages: list[StorageRecord] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    sites: list[str] = field(default_factory=lambda: [""])
    optimizer_steps: list[tuple[int, int]] = field(default_factory=list)
    gradient_readers: list[str] = field(default_factory=list)
    seconds: float = 0.0
    tier_changes: list[tuple[int, dict[int, str]]] = field(default_factory=list)
    module_ids: dict[int, str] = field(default_factory=dict)
