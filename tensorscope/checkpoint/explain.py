"""Text report of a Checkpointable's schedule (``Checkpointable.explain()``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tensorscope._units import format_bytes
from tensorscope.checkpoint.chain import FORWARD_KINDS, Chain, Schedule, format_ops
from tensorscope.checkpoint.solver import min_memory, store_all_memory

if TYPE_CHECKING:
    from tensorscope.checkpoint.profile import Profile

__all__ = ["Explainable", "explain", "layer_roles"]


class Explainable(Protocol):
    """What :func:`explain` reads: ``Checkpointable`` and ``CheckpointedChain`` have it."""

    @property
    def stages(self) -> Sequence[object]: ...

    profile: Profile | None
    schedule: Schedule | None
    mem_limit: int | None
    solved_limit: int | None
    reserved_nbytes: int
    slots: int

    def chain(self) -> Chain: ...


_ROLE = {
    "Fe": "kept with autograd",
    "Fck": "input checkpointed",
    "Fn": "input dropped",
    "Fs": "kept selectively (matmuls and random draws; the rest replayed in backward)",
}


def layer_roles(schedule: Schedule, n_layers: int) -> list[tuple[str, int]]:
    """Per layer: what its first forward does (a key of the role table) and its forward runs.

    Example:
        >>> from tensorscope.checkpoint.chain import Schedule
        >>> ops = (("Fck", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fe", 0), ("B", 0))
        >>> layer_roles(Schedule(5.0, 24, ops, 24), 2)
        [('Fck', 2), ('Fe', 1)]
    """
    first: list[str] = [""] * n_layers
    runs = [0] * n_layers
    for op in schedule.ops:
        if op[0] in FORWARD_KINDS:
            k = op[1]  # type: ignore[misc]
            runs[k] += 1
            first[k] = first[k] or op[0]
    return list(zip(first, runs, strict=True))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


_RESERVED = (
    "the scalar loss and its gradient; saved random states of layers that draw random numbers"
)


def explain(
    module: Explainable,
    *,
    title: str = "Checkpointable",
    unit: str = "layer",
    reserved_what: str = _RESERVED,
    unmeasured: str = "call measure(sample_input) or run one training step",
) -> str:
    """The text behind :meth:`Checkpointable.explain` (and ``CheckpointedChain.explain``)."""
    n = len(module.stages)
    head = f"{title}: {n} {unit}{'s' if n != 1 else ''}"
    if module.profile is None or module.schedule is None:
        given = "default" if module.mem_limit is None else format_bytes(module.mem_limit)
        return f"{head}, mem_limit {given}; not measured yet: {unmeasured}"
    chain = module.chain()
    sched = module.schedule
    top = store_all_memory(chain) + module.reserved_nbytes
    least = min_memory(chain) + module.reserved_nbytes
    limit = module.solved_limit
    if limit is None:
        how = "none (CPU default: every activation stored)"
    elif limit >= top:
        how = f"{format_bytes(limit)} (at or above what storing everything needs)"
    else:
        slot = (limit - module.reserved_nbytes) / module.slots
        how = (
            f"{format_bytes(limit)} (solved on {module.slots} slots of {format_bytes(slot)}; "
            f"the peak below is exact)"
        )
    plain = sum(chain.fw) + sum(chain.bw)
    overhead = (sched.time / plain - 1.0) * 100 if plain > 0 else 0.0
    peak = sched.peak + module.reserved_nbytes
    lines = [
        f"{head}, mem_limit {how}",
        f"predicted step: {_ms(sched.time)} vs {_ms(plain)} storing everything "
        f"({overhead:+.1f}% time); peak {format_bytes(peak)}"
        + (f" of {format_bytes(limit)}" if limit is not None else "")
        + f" (storing everything: {format_bytes(top)}; least possible: {format_bytes(least)})",
    ]
    if module.reserved_nbytes:
        lines.append(
            f"reserved inside the limit: {format_bytes(module.reserved_nbytes)} ({reserved_what})"
        )
    lines.append(f"{unit:>5}  {'module':<18} {'output':>10} {'w/ autograd':>11}  first forward")
    for k, (kind, runs) in enumerate(layer_roles(sched, n)):
        name = module.profile.layers[k].name[:18]
        again = f", recomputed {runs - 1}x" if runs > 1 else ""
        lines.append(
            f"{k:>5}  {name:<18} {format_bytes(chain.x_sizes[k + 1]):>10} "
            f"{format_bytes(chain.xbar_sizes[k + 1]):>11}  {_ROLE[kind]}{again}"
        )
    ops = format_ops(sched.ops)
    lines.append(f"ops ({len(sched.ops)}): {ops if len(ops) <= 400 else ops[:397] + '...'}")
    return "\n".join(lines)
