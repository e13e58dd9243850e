"""``fit.explain()``'s text, from plain facts (pure: no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorscope._units import format_bytes

if TYPE_CHECKING:
    from tensorscope.fit.decide import Candidate, Decision
    from tensorscope.plan.model import MemoryPlan

__all__ = ["Facts", "explain"]


@dataclass(frozen=True)
class Facts:
    """What ``explain`` reports (gathered by the ``Fit`` handle)."""

    model: str
    optimizer: str
    budget_bytes: int
    chain_path: str | None
    chain_blocks: tuple[str, int] | None
    chain_note: str
    schedule_limit: int | None
    decision: Decision | None
    grads_kept_because: tuple[str, ...]
    plan_before: MemoryPlan | None
    plan_after: MemoryPlan | None
    measured_step_s: float | None
    timed_steps: int
    state_where: str
    loss_shape: tuple[int, ...] | None = None
    notes: tuple[str, ...] = ()
    error: str | None = None
    removed: bool = False
    offload_tier: str | None = None  # the tier offloaded blocks go to (None: not considered)
    offload_why_not: str = ""  # why no block is offloaded, when none is
    offload_read_ahead: int = 0  # the offloader's most bytes read back ahead of use
    measured_peak: int = 0  # the recorded step's peak, the read-ahead included
    # (reserved, allocated) peaks of the caching allocator in that step (Nones: none)
    allocator_peaks: tuple[int | None, int | None] = (None, None)
    atomic: bool = False  # ts.fit(..., atomic=True)
    stepwise: bool = False  # a kept-gradient step runs one parameter at a time
    freed: Candidate | None = None  # atomic=True: what ts.fit would choose without it
    across: tuple[str, ...] = ()  # the ranks and their agreement (fit/parts/across.py)
    chunk_rows: int = 0  # rows per chunk of the chunked LM loss (0: it cannot run)
    chunk_why_not: str = ""  # why the LM loss cannot run in chunks
    compile_lines: tuple[str, ...] = ()  # compile=True: what is compiled (parts/compiled.py)


def _runs(choices: tuple[str, ...]) -> list[str]:
    """Consecutive blocks with the same choice, as ``"blocks 0-3  keep"`` lines."""
    out: list[str] = []
    k = 0
    while k < len(choices):
        j = k
        while j + 1 < len(choices) and choices[j + 1] == choices[k]:
            j += 1
        name = f"block {k}" if j == k else f"blocks {k}-{j}"
        out.append(f"{name:<13} {choices[k]}")
        k = j + 1
    return out


def _offload_line(f: Facts) -> str:
    d = f.decision
    chosen = d.chosen if d is not None else None
    if chosen is not None and chosen.offloaded:
        first, last = chosen.offloaded[0], chosen.offloaded[-1]
        which = f"block {first}" if first == last else f"blocks {first}-{last}"
        return (
            f"offload: {which}: their saved tensors ({format_bytes(chosen.offload_nbytes)} a "
            f"step) go to the {f.offload_tier} tier as their forward runs and are read back "
            f"from the backward of the block after them ({format_bytes(chosen.offload_reserve)} "
            f"of the chain's limit set aside for that)"
        )
    if f.offload_tier is None:
        return f"offload: not considered ({f.offload_why_not or 'no block chain measured'})"
    return (
        "offload: considered for the first third, two thirds or all of the blocks; "
        "keeping or recomputing them was predicted faster, or offloading did not fit (its "
        "writes and reads are counted whole, none assumed hidden behind compute)"
    )


def _abort_line(f: Facts, chosen: Candidate) -> str:
    """What an aborted step leaves (NOTE [an aborted step], fit/abort.py)."""
    rule = (
        "aborted steps: an exception out of a step's forward, backward or optimizer.step() "
        "aborts it (ts.fit's own state as if it had not started)"
    )
    if f.atomic:
        alt = f.freed
        if alt is None:
            cost = "no plan freeing gradients at their update fits the budget either"
        else:
            cost = (
                f"without it: predicted peak {format_bytes(alt.predicted_peak)}, "
                f"{alt.predicted_s:.3f} s, against {format_bytes(chosen.predicted_peak)}, "
                f"{chosen.predicted_s:.3f} s with it"
            )
        return (
            f"{rule}; atomic=True: gradients kept until optimizer.step(), which runs whole, so "
            f"parameters and optimizer state stay as they were; its cost: {cost}"
        )
    if f.decision is not None and (f.decision.free_gradients or f.stepwise):
        where = (
            "inside backward" if f.decision.free_gradients else "by optimizer.step() one at a time"
        )
        return (
            f"{rule}; parameters already updated {where} keep their new values (a FitWarning "
            f"names them); ts.fit(..., atomic=True) keeps every step atomic, with gradients "
            f"kept until optimizer.step() and the step run whole"
        )
    return (
        f"{rule}; gradients are kept until optimizer.step(), which runs whole: parameters and "
        f"optimizer state stay as they were"
    )


def explain(f: Facts) -> str:
    """The report (see ``Fit.explain``).

    Example:
        >>> print(explain(Facts("Net", "SGD", 1024, None, None, "no list", None, None, (),
        ...                     None, None, None, 0, "resident on the device")))
        ts.fit: Net + SGD, budget 1.0 KiB (1024 bytes)
          not measured yet: the first training step is recorded, then the plan is decided
    """
    head = (
        f"ts.fit: {f.model} + {f.optimizer}, budget {format_bytes(f.budget_bytes)} "
        f"({f.budget_bytes} bytes)" + (" [removed]" if f.removed else "")
    )
    lines = [head]
    lines += [f"  {line}" for line in f.across]
    if f.error is not None:
        lines.append(f"  no plan: {f.error}")
    if f.plan_before is None:
        if f.error is None:
            lines.append(
                "  not measured yet: the first training step is recorded, then the plan is decided"
            )
        lines += [f"  note: {note}" for note in f.notes]
        return "\n".join(lines)
    how = "every block recomputed while measuring, " if f.chain_path is not None else ""
    lines.append(
        f"  step 1 (recorded, {how}gradients kept): peak {format_bytes(f.plan_before.peak_bytes)}"
    )
    d = f.decision
    if d is None:
        return "\n".join(lines)
    chosen = d.chosen
    base = chosen.base
    lines.append("  decision, from step 2:")
    if f.chain_path is not None and f.chain_blocks is not None and chosen.schedule is not None:
        cls, n = f.chain_blocks
        limit = format_bytes(chosen.chain_limit or 0)
        lines.append(
            f"    block chain {f.chain_path or '(list)'}: {n} x {cls}, rotor's schedule under "
            f"{limit} (context and random states: {format_bytes(d.reserved_nbytes)}; head and "
            f"loss above the chain: {format_bytes(base.loss_tmp)})"
        )
        lines += [f"      {line}" for line in _runs(d.blocks)]
        if "selective" in d.blocks:  # NOTE [selective recomputation], checkpoint/simulate.py
            lines.append(
                "      selective: the block's matmuls' and random draws' results kept, the "
                "rest replayed in its backward (bit-identical)"
            )
    elif f.chain_path is not None:
        lines.append(f"    block chain {f.chain_path or '(list)'}: not measured (no backward ran)")
    else:
        lines.append(f"    no block chain ({f.chain_note}): nothing is recomputed")
    lines.append(f"    {_offload_line(f)}")
    if d.free_gradients:
        how = (
            "per parameter"
            if d.chosen.base.state_offloaded or not f.chain_blocks
            else "a block's parameters at a time, the rest per parameter"
        )
        lines.append(
            f"    gradients: freed at each parameter's update (optimizer-in-backward, "
            f"{f.optimizer} run {how})"
        )
    else:
        lines.append("    gradients: kept until optimizer.step(), because")
        lines += [f"      - {reason}" for reason in f.grads_kept_because] or [
            "      - freeing them at their update predicts no smaller peak and no faster step"
        ]
    if base.chunked_loss:
        lines.append(
            f"    loss: the LM head and cross-entropy in row chunks (up to {f.chunk_rows} rows "
            f"each): the logits and their gradient never exist whole (outputs.logits is None); "
            f"results allclose to plain, not its bits (the sums over rows run in another order)"
        )
    elif f.loss_shape is not None:
        n, v = f.loss_shape
        lines.append(
            f"    loss: cross_entropy over {n} x {v} logits, its gradient written over the saved "
            f"log-probabilities (one buffer of the logits' size less in backward; same bits)"
        )
    lines += [f"    {line}" for line in f.compile_lines]
    lines.append(
        f"    model state: {f.state_where}: parameters {format_bytes(base.parameter_bytes)}, "
        f"optimizer state {'resident at most ' if base.state_offloaded else ''}"
        f"{format_bytes(base.optimizer_state_bytes)}, gradients up to "
        f"{format_bytes(base.gradient_bytes)}"
    )
    for c in d.candidates:
        grads = "freed at update" if c.base.free_gradients else "kept"
        if c.base.state_offloaded:
            grads += f", optimizer state offloaded ({format_bytes(c.base.offloaded_bytes)})"
        if c.base.placed_bytes:
            grads += f", the chain's parameters in files ({format_bytes(c.base.placed_bytes)})"
        if c.base.chunked_loss:
            grads += ", the LM loss in chunks"
        fits = (
            f"predicted peak {format_bytes(c.predicted_peak)}, {c.predicted_s:.3f} s"
            if c.fits
            else "does not fit"
        )
        mark = "*" if c is chosen else " "
        lines.append(
            f"   {mark}candidate, gradients {grads}: {fits} (fits from "
            f"{format_bytes(c.least_budget)})"
        )
    lines.append(f"    {_abort_line(f, chosen)}")
    lines.append(
        f"  predicted: peak {format_bytes(chosen.predicted_peak)}, step "
        f"{chosen.predicted_s:.3f} s (the chain's blocks timed in "
        + ("the first compiled step that compiled nothing" if f.compile_lines else "step 2")
        + "; the rest of the step timed while step 1 was recorded, which slows small ops)"
    )
    if f.plan_after is not None:
        measured = f"  measured: peak {format_bytes(f.plan_after.peak_bytes)} (a recorded step)"
        if chosen.base.placed_bytes:
            ahead = (
                f" and what the offloader read back ahead of use (at most "
                f"{format_bytes(f.offload_read_ahead)}) added"
                if chosen.offloaded
                else ""
            )
            measured += (
                f"; with the chain's parameters counted as mapped in (the recording counts "
                f"their storages whole){ahead}: {format_bytes(f.measured_peak)}"
            )
        elif chosen.offloaded:
            measured += (
                f"; with what the offloader read back ahead of use during the chain's backward "
                f"(at most {format_bytes(f.offload_read_ahead)}, seen by the recording only "
                f"from its use): at most {format_bytes(f.measured_peak)}"
            )
        reserved, allocated = f.allocator_peaks
        if reserved is not None and allocated is not None:
            measured += (
                f"; the device's caching allocator at most {format_bytes(allocated)} allocated, "
                f"{format_bytes(reserved)} reserved (the budget holds against reserved)"
            )
        if f.measured_step_s is not None:
            measured += (
                f", step {f.measured_step_s:.3f} s (median of {f.timed_steps} unrecorded steps)"
            )
        lines.append(measured)
    else:
        lines.append("  measured: not yet (the third step is recorded)")
    lines += [f"  note: {note}" for note in f.notes]
    return "\n".join(lines)
