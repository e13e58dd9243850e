"""``print(plan)``: the peak, what it is made of, and the largest tensors alive at it.

Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorscope._units import format_bytes
from tensorscope.plan.data import CATEGORIES

if TYPE_CHECKING:
    from tensorscope.plan.model import Lifetime, MemoryPlan

__all__ = ["describe", "summary"]


def describe(life: Lifetime) -> str:
    """One tensor in a line: shape, dtype, and its name or where it was made."""
    shape = "x".join(str(d) for d in life.shape) or "scalar"
    where = life.name or life.site or "(made by torch internals)"
    if life.name and life.category in ("gradient", "optimizer_state"):
        where = f"of {life.name}"
    return f"{shape} {life.dtype}  {where}"


_SHARDED = ("sharded_parameter", "unsharded_parameter", "reduce_scatter")


def summary(plan: MemoryPlan) -> str:
    """The text ``str(plan)`` returns."""
    peak = plan.peak_bytes
    where = plan.peak_site or "no user frame"
    lines = [
        f"tensorscope plan: peak {format_bytes(peak)} on {plan.device} at op {plan.peak_op} "
        f"of {len(plan.ops)} ({plan.peak_phase}), {where}",
        f"  the step: {len(plan.ops)} ops in {plan.seconds:.3f} s, "
        f"{len(plan.lifetimes)} storages, {len(plan.blocks)} modules",
        "  at the peak:",
    ]
    # FSDP2's own categories only where they hold bytes
    shown = [c for c in CATEGORIES if plan.at_peak.get(c, 0) or c not in _SHARDED]
    width = max(16, *(len(c) + 1 for c in shown))
    for category in shown:
        nbytes = plan.at_peak.get(category, 0)
        share = 100.0 * nbytes / peak if peak else 0.0
        lines.append(f"    {category:<{width}}{format_bytes(nbytes):>12}  {share:5.1f}%")
    lines.append(f"    {'total':<{width}}{format_bytes(peak):>12}")
    if plan.at_peak_by_tier is not None:
        tiers = ", ".join(
            f"{tier} {format_bytes(sum(row.values()))}"
            for tier, row in plan.at_peak_by_tier.items()
        )
        lines.append(f"  per residency tier at the peak: {tiers}")
    largest = plan.largest_at_peak(10)
    if largest:
        lines.append("  largest tensors alive at the peak:")
        for life in largest:
            lines.append(
                f"    {format_bytes(life.nbytes):>12}  {life.category:<16}{describe(life)}"
            )
    return "\n".join(lines)
