"""``ts.fit``'s decision: one plan for the step under one byte budget (pure: plain data, no torch).

Given what the recorded step holds outside its block chain (account.py, one :class:`StepBase`
per way of handling gradients) and the measured chain (a :class:`~tensorscope.checkpoint.Chain`),
:func:`decide` picks, by predicted time, whether gradients are freed at their update and which
blocks are kept or recomputed (rotor's dynamic program, checkpoint/solver.py), such that the
predicted peak fits the budget. See NOTE [one decision].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from tensorscope._units import format_bytes
from tensorscope.checkpoint.chain import Chain, Schedule, forward_runs
from tensorscope.checkpoint.offloaded import (
    OffloadModel,
    kept_offloaded,
    offload_prefixes,
    predicted_io_s,
    with_offload,
)
from tensorscope.checkpoint.solver import min_memory, solve, store_all_memory
from tensorscope.errors import ScheduleError
from tensorscope.fit.account import StepBase

__all__ = ["BlockChoice", "Candidate", "Decision", "block_choices", "decide"]

BlockChoice = Literal["keep", "recompute", "offload", "selective"]

_SUB = "tensorscope.fit"

# NOTE [one decision]
# The candidates are the ways of running the step outside the chain (gradients kept until the
# optimizer step, or freed at each parameter's update when nothing else reads them); each
# leaves the chain `budget - under_chain` bytes (its mem_limit: the context stored once and
# saved random states come off it first, as in CheckpointedChain), with the loss region's
# excess as rotor's loss_tmp. For each, rotor's DP gives the fastest schedule that fits (or
# stores everything when that fits); the candidate must also fit outside the chain (the
# optimizer step with every gradient alive). Of the candidates that fit, the fastest predicted
# step wins, then the smaller peak, then freeing gradients. Freeing gradients early costs no
# time, so where it is allowed it wins whenever it lets the chain keep more. Nothing fits:
# ScheduleError naming the smallest budget of any candidate.
# Offload is a third choice per block ("offload": its saved tensors leave the device after its
# forward and come back before its backward). Given an OffloadModel (what each block's offload
# moves and costs), each candidate is also solved with a prefix of the chain offloaded
# (checkpoint/offloaded.py, NOTE [offload in rotor's model]); its predicted time adds the
# writes and reads, none assumed hidden behind compute. Offload competes with recomputation on
# predicted time, and lowers the least budget where the saved tensors are the chain's memory.


@dataclass(frozen=True)
class Candidate:
    """One candidate's outcome (feasible or not).

    Attributes:
        base: the step outside the chain for this way of handling gradients.
        least_budget: the smallest budget this candidate fits.
        schedule: rotor's schedule for the chain (None: no chain, or it does not fit).
        chain_limit: bytes given to the chain (its ``mem_limit``; None: no chain).
        predicted_peak: predicted bytes of the step (0 when it does not fit).
        predicted_s: predicted seconds of the step (chain schedule plus the rest, plus the
            offload's writes and reads).
        offloaded: the blocks whose saved tensors go to the next tier after their forward.
        offload_nbytes: bytes those blocks move out and back each step.
        offload_reserve: bytes of the chain's limit set aside for the offload (NOTE [offload
            in rotor's model]); included in ``chain_limit``'s use, not in ``reserve``.
    """

    base: StepBase
    least_budget: int
    schedule: Schedule | None
    chain_limit: int | None
    predicted_peak: int
    predicted_s: float
    offloaded: tuple[int, ...] = ()
    offload_nbytes: int = 0
    offload_reserve: int = 0

    @property
    def fits(self) -> bool:
        """Whether it fits the budget it was evaluated for."""
        return self.predicted_peak > 0


@dataclass(frozen=True)
class Decision:
    """What ``ts.fit`` runs from the second step on.

    Attributes:
        budget_bytes: the budget decided for.
        chosen: the candidate chosen.
        candidates: every candidate considered, in order.
        blocks: per block ``"keep"`` (its activations stay), ``"recompute"``, ``"offload"`` or
            ``"selective"`` (its matmuls' and random draws' results stay, the rest is replayed
            in backward: NOTE [selective recomputation], checkpoint/simulate.py).
        reserved_nbytes: bytes of the chain's limit set aside (shared context, random states).
    """

    budget_bytes: int
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    blocks: tuple[BlockChoice, ...]
    reserved_nbytes: int

    @property
    def free_gradients(self) -> bool:
        """Whether gradients are freed at each parameter's update."""
        return self.chosen.base.free_gradients

    @property
    def least_budget(self) -> int:
        """The smallest budget any candidate fits."""
        return min(c.least_budget for c in self.candidates)


CHUNKED_GAIN = 0.95  # a plan with the LM loss in chunks must be predicted this much faster


def block_choices(
    schedule: Schedule | None, n: int, offloaded: Collection[int] = ()
) -> tuple[BlockChoice, ...]:
    """Per block: ``"recompute"`` when the schedule runs its forward more than once, else
    ``"selective"`` when it runs it as ``Fs``, ``"offload"`` for the blocks in ``offloaded``,
    else ``"keep"``.

    Example:
        >>> from tensorscope.checkpoint.chain import Schedule
        >>> ops = (("Fck", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fe", 0), ("B", 0))
        >>> block_choices(Schedule(0.0, 0, ops, 0), 2)
        ('recompute', 'keep')
    """
    keep: BlockChoice = "keep"
    if schedule is None:
        return (keep,) * n
    runs = forward_runs(schedule.ops)
    recompute: BlockChoice = "recompute"
    offload: BlockChoice = "offload"
    selective: BlockChoice = "selective"
    sel = {op[1] for op in schedule.ops if op[0] == "Fs"}  # type: ignore[misc]
    return tuple(
        recompute if runs[k] > 1 else selective if k in sel else offload if k in offloaded else keep
        for k in range(n)
    )


def _evaluate(
    budget: int,
    base: StepBase,
    chain: Chain | None,
    reserve: int,
    slots: int,
    offload: OffloadModel | None = None,
) -> Candidate:
    """The best of: no block offloaded, and each offloaded prefix (NOTE [offload in rotor's
    model]), by predicted time, then peak; the least budget is the least of them all."""
    plain = _evaluate_with(budget, base, chain, reserve, slots, None, ())
    if chain is None or offload is None:
        return plain
    options = [plain]
    for j in offload_prefixes(chain.length, offload):
        options.append(_evaluate_with(budget, base, chain, reserve, slots, offload, range(j)))
    least = min(o.least_budget for o in options)
    fitting = [o for o in options if o.fits]
    best = min(fitting, key=lambda o: (o.predicted_s, o.predicted_peak)) if fitting else plain
    return dataclasses.replace(best, least_budget=least)


def _evaluate_with(
    budget: int,
    base: StepBase,
    chain: Chain | None,
    reserve: int,
    slots: int,
    offload: OffloadModel | None,
    prefix: Sequence[int],
) -> Candidate:
    if chain is None:
        least = max(base.outside, base.under_chain, base.at_loss)
        fits = budget >= least
        return Candidate(base, least, None, None, least if fits else 0, base.seconds)
    chain = dataclasses.replace(chain, loss_tmp=base.loss_tmp)
    tried: dict[tuple[int, ...], Candidate] = {}

    def attempt(blocks: tuple[int, ...]) -> Schedule | None:
        tried[blocks] = _solve_with(budget, base, chain, reserve, slots, offload, blocks)
        return tried[blocks].schedule

    prefix = [k for k in prefix if offload is not None and offload.worth(k)]
    schedule, blocks = kept_offloaded(prefix, attempt)
    solved = tried[blocks]
    if schedule is None or offload is None:
        return solved
    return dataclasses.replace(
        solved,
        predicted_s=solved.predicted_s + predicted_io_s(offload, blocks),
        offloaded=blocks,
        offload_nbytes=sum(offload.nbytes[k] for k in blocks),
    )


def _solve_with(
    budget: int,
    base: StepBase,
    chain: Chain,
    reserve: int,
    slots: int,
    offload: OffloadModel | None,
    blocks: Sequence[int],
) -> Candidate:
    chain, extra = with_offload(chain, offload, blocks)
    reserve += extra
    least = max(base.outside, base.under_chain + reserve + min_memory(chain))
    top = store_all_memory(chain)
    limit = budget - base.under_chain
    room = limit - reserve
    if budget < least:
        return Candidate(base, least, None, limit, 0, 0.0)
    try:
        schedule = solve(chain, top) if room >= top else solve(chain, room, slots=slots)
    except ScheduleError:  # the discretised DP found nothing at this room
        return Candidate(base, max(least, budget + 1), None, limit, 0, 0.0)
    peak = max(base.outside, base.under_chain + reserve + schedule.peak)
    candidate = Candidate(base, least, schedule, limit, peak, base.seconds + schedule.time)
    return dataclasses.replace(candidate, offload_reserve=extra)


def decide(
    budget: int,
    bases: Sequence[StepBase],
    chain: Chain | None = None,
    *,
    reserve: int = 0,
    slots: int = 500,
    what: str = "the step",
    offload: OffloadModel | None = None,
) -> Decision:
    """The fastest plan whose predicted peak fits ``budget`` (NOTE [one decision]).

    Args:
        budget: bytes the whole step may hold.
        bases: one :class:`StepBase` per way of handling gradients to consider.
        chain: the measured block chain (its ``loss_tmp`` is replaced per base); None: none.
        reserve: bytes of the chain's limit set aside (context stored once, random states).
        slots: the DP's memory resolution (``budget / slots`` units).
        what: how error messages name the step.
        offload: what offloading each block moves and costs (None: no block is offloaded).

    Raises:
        ScheduleError: no candidate fits; the message names the smallest budget that does.

    Example:
        >>> from tensorscope.checkpoint.chain import Chain
        >>> chain = Chain([1.0] * 4, [2.0] * 4, [10] * 5, [0] + [40] * 4, [0] * 4, [0] * 4)
        >>> kept = StepBase(False, 500, 600, 700, 300, 100, 100, 1.0)
        >>> freed = StepBase(True, 420, 520, 420, 300, 20, 100, 1.0)
        >>> d = decide(640, [kept, freed], chain)
        >>> d.free_gradients, d.blocks, d.chosen.predicted_peak <= 640
        (True, ('keep', 'keep', 'recompute', 'recompute'), True)
        >>> cheap = OffloadModel((30,) * 4, (0.1,) * 4)  # moving a block beats recomputing it
        >>> moved = decide(640, [kept, freed], chain, offload=cheap)
        >>> moved.blocks, moved.chosen.predicted_s < d.chosen.predicted_s
        (('offload', 'offload', 'offload', 'offload'), True)
    """
    if not bases:
        raise ValueError("decide() needs at least one StepBase")
    candidates = tuple(_evaluate(budget, base, chain, reserve, slots, offload) for base in bases)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(c.least_budget for c in candidates)
        raise ScheduleError(
            f"{_SUB}: no plan fits {what} into budget={format_bytes(budget)} ({budget} bytes): "
            f"the smallest budget that fits is {format_bytes(least)} ({least} bytes)"
            + _why(candidates)
            + ". Raise the budget, or use a smaller batch or sequence."
        )
    # NOTE [when the loss runs in chunks] (fit/parts/chunked.py): the plain loss (its bits)
    # unless none fits or the chunked one is predicted CHUNKED_GAIN faster
    exact = [c for c in fitting if not c.base.chunked_loss]
    if exact:
        fastest = min(c.predicted_s for c in exact)
        fitting = exact + [
            c for c in fitting if c.base.chunked_loss and c.predicted_s < fastest * CHUNKED_GAIN
        ]
    chosen = min(
        fitting,
        key=lambda c: (
            c.predicted_s,
            c.base.chunked_loss,
            c.predicted_peak,
            not c.base.free_gradients,
        ),
    )
    n = len(chain.fw) if chain is not None else 0
    blocks = block_choices(chosen.schedule, n, chosen.offloaded)
    return Decision(budget, chosen, candidates, blocks, reserve)


def _why(candidates: Sequence[Candidate]) -> str:
    best = min(candidates, key=lambda c: c.least_budget)
    base = best.base
    grads = "freed at their update" if base.free_gradients else "kept until the optimizer step"
    if base.state_offloaded:
        grads += " and the optimizer state offloaded between updates"
    if base.placed_bytes:
        grads += ", the chain's parameters in files between their uses"
    return (
        f" (with gradients {grads}: model state and what the step holds outside the block "
        f"chain need {format_bytes(max(base.outside, base.under_chain))}, "
        f"the chain at least the rest)"
    )
